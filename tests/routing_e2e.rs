//! Pool routing, backend health and streaming through the proxy.

mod common;
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn set_health(sim: &Proc, healthy: bool) {
    sim_admin(sim, "/admin/health", json!({"healthy": healthy})).await;
}

#[tokio::test]
async fn best_effort_is_evicted_from_an_unhealthy_spot_pool() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    set_health(&sp, false).await;
    wait_for(Duration::from_secs(5), "spot to turn unhealthy", || async {
        let st = s.status().await;
        let spot = st["pools"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == "spot")?
            .clone();
        (spot["healthy_backends"] == 0).then_some(())
    })
    .await;
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-pool"), "on-demand");
    let d = s.record(header(&r, "x-request-id")).await;
    assert_eq!(d["route_reason"], "route_spot_unhealthy_evicted");
    assert_eq!(sim_stats(&sp).await["received"], 0);

    set_health(&sp, true).await;
    wait_for(
        Duration::from_secs(5),
        "Best-Effort back on spot",
        || async {
            let r = s
                .chat("batch-analytics", chat_body("llama-3-70b", Some(1)))
                .await;
            (header(&r, "x-sluice-pool") == "spot").then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn spot_pressure_evicts_best_effort() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    sim_admin(&sp, "/admin/kv", json!({"usage": 0.95})).await;
    wait_for(Duration::from_secs(5), "spot Critical", || async {
        (s.status().await["spot_state"] == "Critical").then_some(())
    })
    .await;
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(header(&r, "x-sluice-pool"), "on-demand");
    let st = s.status().await;
    assert_eq!(
        st["signals"]["spot"]["pressure"]["value"], 95.0,
        "read from the simulator's vLLM metrics"
    );
}

#[tokio::test]
async fn no_healthy_backend_answers_503() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    set_health(&od, false).await;
    set_health(&sp, false).await;
    wait_for(Duration::from_secs(5), "/readyz to turn 503", || async {
        let r = client().get(s.ops_url("/readyz")).send().await.ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    // Readiness follows on-demand only; spot's own check may fail a moment later.
    wait_for(
        Duration::from_secs(5),
        "every pool to turn unhealthy",
        || async {
            let st = s.status().await;
            let pools = st["pools"].as_array()?.clone();
            pools
                .iter()
                .all(|p| p["healthy_backends"] == 0)
                .then_some(())
        },
    )
    .await;
    for tenant in ["support-bot", "batch-analytics"] {
        let r = s.chat(tenant, chat_body("llama-3-70b", Some(5))).await;
        assert_eq!(r.status(), 503);
        assert_eq!(header(&r, "x-sluice-reason"), "backend_unavailable");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "sluice_backend");
        assert_eq!(body["error"]["code"], "backend_unavailable");
    }
    assert_eq!(sim_stats(&od).await["received"], 0);
    // /livez stays up: the process is fine, its backends are not.
    assert_eq!(
        client()
            .get(s.ops_url("/livez"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn a_never_checked_backend_is_not_used() {
    // The spot address has nothing listening: it can never pass a check.
    let od = sim("llama-3-70b", &[]).await;
    let dead = format!("127.0.0.1:{}", free_port());
    let s = serve(&config(&[&od.addr], &[&dead])).await;
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-pool"), "on-demand");
}

#[tokio::test]
async fn sse_streams_chunk_by_chunk_and_holds_the_slot_until_the_end() {
    let od = sim("llama-3-70b", &["--itl-ms", "40"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    let mut body = chat_body("llama-3-70b", Some(25));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let started = Instant::now();
    let r = s.chat("coding-assistant", body).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "content-type").starts_with("text/event-stream"));
    let id = header(&r, "x-request-id").to_string();
    let mut stream = r.bytes_stream();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    let mut inflight_mid_stream = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        arrivals.push(started.elapsed());
        text.push_str(&String::from_utf8_lossy(&chunk));
        if arrivals.len() == 5 {
            let t = s.tier("Standard").await;
            inflight_mid_stream = t["inflight"].as_u64();
        }
    }
    let total = started.elapsed();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        arrivals.len() >= 10,
        "{} reads: the stream was buffered",
        arrivals.len()
    );
    assert!(
        arrivals[0] < total / 2,
        "first chunk at {:?} of {total:?}",
        arrivals[0]
    );
    assert_eq!(
        inflight_mid_stream,
        Some(1),
        "the slot is held while the stream runs"
    );
    wait_for(
        Duration::from_secs(3),
        "the slot to be released",
        || async {
            let t = s.tier("Standard").await;
            (t["inflight"] == 0).then_some(())
        },
    )
    .await;
    let d = s.record(&id).await;
    assert_eq!(
        d["completion_tokens"], 25,
        "usage read from the final SSE chunk"
    );
    assert_eq!(d["stream"], true);
}

#[tokio::test]
async fn a_refused_connection_is_retried_on_another_backend() {
    let a = sim("llama-3-70b", &[]).await;
    let b = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&a.addr, &b.addr], &[&sp.addr]);
    // Health checks far apart: the dead backend still looks healthy when requests arrive.
    merge(
        &mut cfg,
        json!({"pools": {"on-demand": {"health_check": {"interval_ms": 60000}}}}),
    );
    let s = serve(&cfg).await;
    drop(b); // killed: connections to it are refused
    for _ in 0..6 {
        let r = s
            .chat("support-bot", chat_body("llama-3-70b", Some(2)))
            .await;
        assert_eq!(r.status(), 200, "retried on the live backend");
    }
    assert_eq!(sim_stats(&a).await["received"], 6);
}

#[tokio::test]
async fn a_stream_longer_than_the_read_timeout_is_not_cut() {
    let od = sim("llama-3-70b", &["--itl-ms", "100"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"limits": {"upstream_read_timeout_ms": 600}}),
    );
    let s = serve(&cfg).await;
    let mut body = chat_body("llama-3-70b", Some(15));
    body["stream"] = json!(true);
    let started = Instant::now();
    let r = s.chat("support-bot", body).await;
    let text = r.text().await.unwrap();
    assert!(
        started.elapsed() > Duration::from_millis(1200),
        "the generation outlasted the read timeout"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}
