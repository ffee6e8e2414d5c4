//! The simulator's two engine models over HTTP: answers that end before `max_tokens` (the
//! `x-sim-output-tokens` hint), and `--kv-reserve max-tokens`, where every request holds prompt +
//! max_tokens from admission to its end, so the waiting queue forms at a low real KV usage.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// 100 characters: 25 prompt tokens at the simulator's four characters a token.
fn body(stream: bool) -> Value {
    let mut b = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "x".repeat(100)}],
        "max_tokens": 100,
    });
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// Sends a chat request with `x-sim-output-tokens: hint`; returns the status and the answer's
/// (completion tokens, finish reason), read from the body or, streamed, from its events.
async fn ask(url: String, hint: &str, stream: bool) -> (u16, Value, Value) {
    let r = client()
        .post(url)
        .header("x-sim-output-tokens", hint)
        .json(&body(stream))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    if !stream || status != 200 {
        let v: Value = serde_json::from_str(&text).unwrap();
        return (
            status,
            v["usage"]["completion_tokens"].clone(),
            v["choices"][0]["finish_reason"].clone(),
        );
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<Value> = text
        .split_terminator("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let tokens = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["content"] == "tok ")
        .count();
    let finish = events
        .iter()
        .find_map(|e| e["choices"][0]["finish_reason"].as_str())
        .map_or(Value::Null, Value::from);
    let usage = events
        .iter()
        .find_map(|e| e["usage"]["completion_tokens"].as_u64())
        .unwrap();
    assert_eq!(tokens as u64, usage, "token chunks and usage agree");
    (status, json!(usage), finish)
}

/// `(running, waiting, kv usage)` as the simulator's `/metrics` reports them.
async fn gauges(sim: &Proc) -> (f64, f64, f64) {
    let text = client()
        .get(sim.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let gauge = |name: &str| {
        let prefix = format!("{name}{{model_name=\"m\",engine=\"0\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in {text}"))
    };
    (
        gauge("vllm:num_requests_running"),
        gauge("vllm:num_requests_waiting"),
        gauge("vllm:kv_cache_usage_perc"),
    )
}

async fn gauges_until(sim: &Proc, what: &str, want: impl Fn((f64, f64, f64)) -> bool) -> f64 {
    wait_for(Duration::from_secs(10), what, || async {
        let g = gauges(sim).await;
        want(g).then_some(g.2)
    })
    .await
}

/// Starts two 25-prompt-token requests that stop after 5 of their 100 allowed tokens on a
/// 200-token cache, the first held in prefill for a few seconds, and returns both once the
/// second has either started or queued.
async fn two_early_enders(
    sim: &Proc,
) -> (
    tokio::task::JoinHandle<(u16, Value, Value)>,
    tokio::task::JoinHandle<(u16, Value, Value)>,
) {
    sim_admin(sim, "/admin/latency", json!({"extra_ms": 3000})).await;
    let url = sim.url("/v1/chat/completions");
    let first = tokio::spawn(ask(url.clone(), "5", false));
    gauges_until(sim, "the first request running", |g| g.0 == 1.0).await;
    let second = tokio::spawn(ask(url, "5", true));
    (first, second)
}

#[tokio::test]
async fn max_tokens_reservation_queues_requests_at_low_real_usage() {
    let s = sim("m", &["--kv-reserve", "max-tokens", "--kv-tokens", "200"]).await;
    let url = s.url("/v1/chat/completions");

    // (a) The hint ends the answer early, streamed or not.
    for stream in [false, true] {
        assert_eq!(
            ask(url.clone(), "5", stream).await,
            (200, json!(5), json!("stop")),
            "stream {stream}"
        );
    }
    assert_eq!(
        ask(url.clone(), "500", false).await,
        (200, json!(100), json!("length"))
    );
    let r = client()
        .post(url.clone())
        .header("x-sim-output-tokens", "five")
        .json(&body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!((&v["object"], &v["code"]), (&json!("error"), &json!(400)));
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .starts_with("x-sim-output-tokens: "),
        "{v}"
    );

    // (b) While the first runs, its whole 25 + 100 tokens are reserved, not the 25 + 5 it writes.
    let (first, second) = two_early_enders(&s).await;
    // (c) The second needs 125 of the 75 left, so it waits although only 30 tokens are written.
    let kv = gauges_until(&s, "the second request waiting", |g| {
        (g.0, g.1) == (1.0, 1.0)
    })
    .await;
    assert_eq!(kv, 0.625);
    let stats = sim_stats(&s).await;
    assert_eq!(
        (&stats["kv_used_tokens"], &stats["kv_written_tokens"]),
        (&json!(125), &json!(30))
    );

    sim_admin(&s, "/admin/latency", json!({"extra_ms": 0})).await;
    assert_eq!(first.await.unwrap(), (200, json!(5), json!("stop")));
    assert_eq!(second.await.unwrap(), (200, json!(5), json!("stop")));
    // A stream's reservation goes back just after its last event, so the client may be first.
    gauges_until(&s, "the cache to empty", |g| g == (0.0, 0.0, 0.0)).await;
}

#[tokio::test]
async fn output_reservation_runs_the_same_requests_side_by_side() {
    // Without the prefix cache the two identical prompts each hold their own blocks.
    let s = sim("m", &["--kv-tokens", "200", "--prefix-caching", "off"]).await;
    let (first, second) = two_early_enders(&s).await;
    let kv = gauges_until(&s, "both requests running", |g| (g.0, g.1) == (2.0, 0.0)).await;
    // 2 × (25 + 5) of 200.
    assert_eq!(kv, 0.3);
    sim_admin(&s, "/admin/latency", json!({"extra_ms": 0})).await;
    for r in [first, second] {
        assert_eq!(r.await.unwrap(), (200, json!(5), json!("stop")));
    }
}
