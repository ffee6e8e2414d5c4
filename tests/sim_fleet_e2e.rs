//! The simulator as one replica of a fleet, over real HTTP against the real `sluice sim` binary:
//! the prefix cache (hits, cheaper prefill, eviction under KV pressure or a capped cache, the
//! cached count in `usage`), vLLM's `priority` field (ordering under `--scheduling-policy
//! priority`, a 400 under FCFS), aborts when the client goes away, runtime LoRA adapters, and
//! the per-model request counts a routing proxy is checked with.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Exactly `chars` characters of system prompt, distinct per `tag` from its first block on.
fn system_prompt(tag: &str, chars: usize) -> String {
    let mut s = format!("[{tag}] You are a careful assistant for the Sluice fleet. ");
    while s.len() < chars {
        s.push_str("Answer briefly, cite the runbook, never guess. ");
    }
    s.truncate(chars);
    s
}

/// A chat body: a system prompt, a short user turn, one answer token.
fn chat(system: &str, user: &str) -> Value {
    json!({
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
}

/// Sends `body` to `/v1/chat/completions`; returns the response and how long it took.
async fn timed(sim: &Proc, body: &Value) -> (reqwest::Response, Duration) {
    let start = Instant::now();
    let r = client()
        .post(sim.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let took = start.elapsed();
    assert_eq!(r.status(), 200, "{body}");
    (r, took)
}

fn cached_tokens(r: &reqwest::Response) -> u64 {
    header(r, "x-sim-cached-tokens").parse().unwrap()
}

async fn metrics(sim: &Proc) -> String {
    client()
        .get(sim.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// One series' value, by its exact name and labels.
fn series(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{series} in {text}"))
}

const LABELS: &str = "{model_name=\"m\",engine=\"0\"}";

#[tokio::test]
async fn a_repeated_system_prompt_hits_the_prefix_cache_and_starts_sooner() {
    // 2,000 uncached prompt tokens cost 200 ms of prefill; 5 ms is the floor.
    let s = sim("m", &["--ttft-ms", "5", "--prefill-us-per-token", "100"]).await;
    // 8,000 characters: 2,000 tokens, 125 full blocks of 16, all system prompt.
    let shared = system_prompt("shared", 8000);

    let (r, cold) = timed(&s, &chat(&shared, "What is a pool?")).await;
    assert_eq!(cached_tokens(&r), 0);
    let (r, warm) = timed(&s, &chat(&shared, "And a tier?")).await;
    assert_eq!(cached_tokens(&r), 2000);
    // Another system prompt of the same length is cold again: the speed-up is the cache's.
    let (r, other) = timed(&s, &chat(&system_prompt("other", 8000), "And a tier?")).await;
    assert_eq!(cached_tokens(&r), 0);
    assert!(cold >= Duration::from_millis(200), "{cold:?}");
    assert!(other >= Duration::from_millis(200), "{other:?}");
    assert!(
        warm + Duration::from_millis(100) < cold.min(other),
        "cached {warm:?}, uncached {cold:?} / {other:?}"
    );

    // vLLM's counters, in tokens: every prompt token is a query, the cached ones hits.
    let m = metrics(&s).await;
    let prompts: f64 = [15.0, 11.0, 11.0]
        .iter()
        .map(|u| 2000.0 + f64::ceil(u / 4.0))
        .sum();
    assert_eq!(
        series(&m, &format!("vllm:prefix_cache_queries_total{LABELS}")),
        prompts
    );
    assert_eq!(
        series(&m, &format!("vllm:prefix_cache_hits_total{LABELS}")),
        2000.0
    );
    assert!(m.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
    let stats = sim_stats(&s).await;
    assert_eq!(stats["prefix_cache_queries_tokens"], prompts as u64);
    assert_eq!(stats["prefix_cache_hit_tokens"], 2000);
}

#[tokio::test]
async fn prefix_caching_off_never_hits() {
    let s = sim("m", &["--prefix-caching", "off"]).await;
    let shared = system_prompt("shared", 8000);
    for user in ["one?", "two?"] {
        let (r, _) = timed(&s, &chat(&shared, user)).await;
        assert_eq!(cached_tokens(&r), 0);
    }
    let stats = sim_stats(&s).await;
    assert_eq!(
        (
            &stats["prefix_cache_queries_tokens"],
            &stats["kv_cached_free_tokens"]
        ),
        (&json!(0), &json!(0))
    );
}

#[tokio::test]
async fn cached_blocks_give_way_under_kv_pressure() {
    let s = sim("m", &["--kv-tokens", "3000"]).await;
    let a = chat(&system_prompt("a", 8000), "question");
    // 2,002 prompt tokens: 125 blocks stay cached, in free KV, after the request.
    timed(&s, &a).await;
    let stats = sim_stats(&s).await;
    assert_eq!(
        (&stats["kv_used_tokens"], &stats["kv_cached_free_tokens"]),
        (&json!(0), &json!(2000))
    );
    // Cached but unused blocks are free KV, as vLLM's usage gauge counts them.
    let m = metrics(&s).await;
    assert_eq!(
        series(&m, &format!("vllm:kv_cache_usage_perc{LABELS}")),
        0.0
    );
    let (r, _) = timed(&s, &a).await;
    assert_eq!(cached_tokens(&r), 2000);

    // 2,502 tokens fit only by evicting: 498 free tokens keep 31 blocks, the head of a's prompt
    // (a request's tail blocks are freed first, so they are evicted first).
    let (r, _) = timed(&s, &chat(&system_prompt("b", 10_000), "x")).await;
    assert_eq!(cached_tokens(&r), 0);
    let (r, _) = timed(&s, &a).await;
    assert_eq!(cached_tokens(&r), 31 * 16);
    let stats = sim_stats(&s).await;
    assert_eq!(stats["kv_used_tokens"], 0);
    // a's 125 blocks and what a left of b's 156: the cache never outgrows the budget.
    assert_eq!(stats["kv_cached_free_tokens"], 3000 / 16 * 16);
}

/// The cached tokens of a request with system prompt `head`, as the header and as vLLM's usage
/// says them.
async fn cached_in_usage(s: &Proc, head: &str) -> u64 {
    let (r, _) = timed(s, &chat(&system_prompt(head, 8000), "question")).await;
    let header = cached_tokens(&r);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(header),
        "{body}"
    );
    header
}

#[tokio::test]
async fn a_small_prefix_cache_thrashes_and_usage_says_what_it_served() {
    // Room for a running batch of many heads, but two heads' worth of free cache.
    let s = sim(
        "m",
        &[
            "--prefix-cache-tokens",
            "4000",
            "--enable-prompt-tokens-details",
        ],
    )
    .await;
    // Two heads fit: each hits on its next turn.
    assert_eq!(
        (
            cached_in_usage(&s, "a").await,
            cached_in_usage(&s, "b").await
        ),
        (0, 0)
    );
    assert_eq!(
        (
            cached_in_usage(&s, "a").await,
            cached_in_usage(&s, "b").await
        ),
        (2000, 2000)
    );
    // Three in turn do not: each evicts the oldest before it comes back.
    assert_eq!(cached_in_usage(&s, "c").await, 0);
    assert_eq!(
        (
            cached_in_usage(&s, "a").await,
            cached_in_usage(&s, "b").await,
            cached_in_usage(&s, "c").await
        ),
        (0, 0, 0)
    );
    let stats = sim_stats(&s).await;
    assert!(stats["kv_cached_free_tokens"].as_u64().unwrap() <= 4000);
}

/// Sends a chat request tagged `id` with `priority`; returns when it finished.
async fn prioritized(sim: &Proc, id: &str, priority: i64) -> (String, Instant, f64) {
    let r = client()
        .post(sim.url("/v1/chat/completions"))
        .header("x-request-id", id)
        .json(
            &json!({"model": "m", "messages": [{"role": "user", "content": id}],
                      "max_tokens": 2, "priority": priority}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{id}");
    let queue_ms = header(&r, "x-sim-queue-ms").parse().unwrap();
    r.bytes().await.unwrap();
    (id.to_string(), Instant::now(), queue_ms)
}

async fn stats_until(sim: &Proc, what: &str, want: impl Fn(&Value) -> bool) -> Value {
    wait_for(Duration::from_secs(10), what, || async {
        let s = sim_stats(sim).await;
        want(&s).then_some(s)
    })
    .await
}

#[tokio::test]
async fn priority_policy_admits_lower_values_first() {
    let s = sim(
        "m",
        &["--max-running", "1", "--scheduling-policy", "priority"],
    )
    .await;
    // The blocker holds the only running slot while the others queue behind it.
    sim_admin(&s, "/admin/latency", json!({"extra_ms": 1500})).await;
    let s = std::sync::Arc::new(s);
    let spawn = |id: &'static str, priority: i64| {
        let s = s.clone();
        tokio::spawn(async move { prioritized(&s, id, priority).await })
    };
    let mut tasks = vec![spawn("blocker", 0)];
    stats_until(&s, "the blocker running", |st| st["running"] == 1).await;
    sim_admin(&s, "/admin/latency", json!({"extra_ms": 0})).await;
    for (n, (id, priority)) in [("p3", 3), ("p0", 0), ("pm1", -1), ("p2", 2)]
        .into_iter()
        .enumerate()
    {
        tasks.push(spawn(id, priority));
        stats_until(&s, id, |st| st["waiting"] == n as u64 + 1).await;
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }

    // Lower values first, whatever the arrival order; the blocker was already running.
    let want = ["blocker", "pm1", "p0", "p2", "p3"];
    done.sort_by_key(|(_, finished, _)| *finished);
    let finished: Vec<&str> = done.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(finished, want);
    let stats = sim_stats(&s).await;
    let admitted: Vec<&str> = stats["admissions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["request_id"].as_str().unwrap())
        .collect();
    assert_eq!(admitted, want);
    assert_eq!(
        stats["admitted_by_priority"],
        json!({"-1": 1, "0": 2, "2": 1, "3": 1})
    );
    // p3 arrived first yet waited longest.
    let wait = |id: &str| done.iter().find(|d| d.0 == id).unwrap().2;
    assert!(wait("pm1") < wait("p0") && wait("p2") < wait("p3"));
}

#[tokio::test]
async fn fcfs_refuses_a_nonzero_priority_with_vllms_400() {
    let s = sim("m", &[]).await;
    let ask = |priority: Value| {
        client()
            .post(s.url("/v1/chat/completions"))
            .json(&json!({"messages": [], "max_tokens": 1, "priority": priority}))
            .send()
    };
    for p in [1, -1] {
        let r = ask(json!(p)).await.unwrap();
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap(),
            json!({"object": "error",
                   "message": format!("Got priority {p} but Priority scheduling is not enabled."),
                   "type": "BadRequestError", "param": null, "code": 400})
        );
    }
    let r = ask(json!("urgent")).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["message"],
        "priority: Input should be a valid integer"
    );
    assert_eq!(ask(json!(0)).await.unwrap().status(), 200);
    let stats = sim_stats(&s).await;
    assert_eq!(
        (&stats["received"], &stats["completed"]),
        (&json!(4), &json!(1))
    );
}

/// Writes a chat request on a bare connection and leaves the answer unread, so the test decides
/// when the client goes away.
async fn raw_chat(sim: &Proc, body: &Value) -> tokio::net::TcpStream {
    let mut conn = tokio::net::TcpStream::connect(&sim.addr).await.unwrap();
    let body = body.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        sim.addr,
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    conn
}

/// Closes `conn` and returns how long the simulator took to count the abort, failing past
/// 200 ms (the simulator sees the close at once; the slack is for a busy test machine).
async fn close_and_time(sim: &Proc, conn: tokio::net::TcpStream, aborted: u64) -> Duration {
    let start = Instant::now();
    drop(conn);
    loop {
        let stats = sim_stats(sim).await;
        if stats["aborted"] == aborted {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_millis(200),
            "abort {aborted} not counted: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_client_that_goes_away_aborts_its_request_and_frees_its_kv() {
    let s = sim("m", &["--max-running", "1"]).await;
    sim_admin(&s, "/admin/latency", json!({"extra_ms": 5000})).await;
    let body = |stream: bool| {
        json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(400)}],
               "max_tokens": 4000, "stream": stream})
    };
    let running = raw_chat(&s, &body(false)).await;
    stats_until(&s, "one running", |st| st["running"] == 1).await;
    let queued = raw_chat(&s, &body(false)).await;
    let queued_stream = raw_chat(&s, &body(true)).await;
    let stats = stats_until(&s, "two waiting", |st| st["waiting"] == 2).await;
    assert_eq!(stats["kv_used_tokens"], 4100);

    let mut took = Vec::new();
    took.push(close_and_time(&s, queued, 1).await);
    took.push(close_and_time(&s, queued_stream, 2).await);
    assert_eq!(sim_stats(&s).await["waiting"], 0);
    took.push(close_and_time(&s, running, 3).await);
    let stats = sim_stats(&s).await;
    assert_eq!(
        (&stats["running"], &stats["kv_used_tokens"]),
        (&json!(0), &json!(0))
    );

    // A stream cut off mid-answer.
    sim_admin(&s, "/admin/latency", json!({"extra_ms": 0})).await;
    let mut streaming = raw_chat(&s, &body(true)).await;
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"tok \"") {
        let mut buf = [0u8; 4096];
        let n = streaming.read(&mut buf).await.unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(sim_stats(&s).await["running"], 1);
    took.push(close_and_time(&s, streaming, 4).await);
    let stats = sim_stats(&s).await;
    assert_eq!(
        (
            &stats["running"],
            &stats["waiting"],
            &stats["kv_used_tokens"],
            &stats["completed"]
        ),
        (&json!(0), &json!(0), &json!(0), &json!(0))
    );
    let m = metrics(&s).await;
    assert_eq!(
        series(
            &m,
            "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"abort\"}"
        ),
        4.0
    );
    eprintln!("aborts counted after {took:?}");
}

#[tokio::test]
async fn a_lora_adapter_loaded_at_runtime_is_listed_routable_and_unloadable() {
    let s = sim("base,other", &["--lora", "fixed=/adapters/fixed"]).await;
    let ask = |model: &str| {
        client()
            .post(s.url("/v1/chat/completions"))
            .json(&json!({"model": model, "messages": [], "max_tokens": 1}))
            .send()
    };
    let ids = || async {
        get_json(&s.url("/v1/models")).await["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let lora = |path: &str, body: Value| client().post(s.url(path)).json(&body).send();

    assert_eq!(ids().await, ["base", "other", "fixed"]);
    assert_eq!(ask("fixed").await.unwrap().status(), 200);
    let r = ask("late").await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["message"],
        "The model `late` does not exist."
    );

    let r = lora(
        "/v1/load_lora_adapter",
        json!({"lora_name": "late", "lora_path": "/adapters/late"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        "Success: LoRA adapter 'late' added successfully."
    );
    let models = get_json(&s.url("/v1/models")).await;
    let card = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "late")
        .unwrap()
        .clone();
    assert_eq!(
        (&card["root"], &card["parent"]),
        (&json!("/adapters/late"), &json!("base"))
    );
    let r = ask("late").await.unwrap();
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-sim-model")),
        (200, "late")
    );
    assert_eq!(r.json::<Value>().await.unwrap()["model"], "late");
    let r = lora(
        "/v1/load_lora_adapter",
        json!({"lora_name": "late", "lora_path": "/elsewhere"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);

    let r = lora("/v1/unload_lora_adapter", json!({"lora_name": "late"}))
        .await
        .unwrap();
    assert_eq!(
        (r.status().as_u16(), r.text().await.unwrap()),
        (
            200,
            "Success: LoRA adapter 'late' removed successfully.".to_string()
        )
    );
    assert_eq!(ids().await, ["base", "other", "fixed"]);
    assert_eq!(ask("late").await.unwrap().status(), 404);
    let r = lora("/v1/unload_lora_adapter", json!({"lora_name": "late"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(ask("other").await.unwrap().status(), 200);

    // Every request counted under the model it named, served or refused.
    assert_eq!(
        sim_stats(&s).await["requests_by_model"],
        json!({"fixed": 1, "late": 3, "other": 1})
    );
}
