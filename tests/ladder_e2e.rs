//! Queueing at capacity and fallback under sustained pressure, over real HTTP.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Standard capacity 1 and a queue of 1: the first request holds the slot while the
/// simulator is slow, so the second queues and the third finds the queue full.
async fn queue_setup(max_wait_seconds: f64) -> (Proc, Proc, Sluice) {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({
            "tiers": {"Standard": {"inflight_capacity": 1}},
            "queue": {"max_size": 1, "max_wait_seconds": max_wait_seconds},
        }),
    );
    let s = serve(&cfg).await;
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 800})).await;
    (od, sp, s)
}

#[tokio::test]
async fn queue_released_then_dropped_when_full() {
    let (od, _sp, s) = queue_setup(5.0).await;
    let s = std::sync::Arc::new(s);
    let first = {
        let s = s.clone();
        tokio::spawn(async move {
            s.chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = {
        let s = s.clone();
        tokio::spawn(async move {
            s.chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
                .await
        })
    };
    // Wait until the second is visibly queued, then the third overflows the queue.
    wait_for(
        Duration::from_secs(5),
        "a queued Standard request",
        || async {
            let std = s.tier("Standard").await;
            (std["queued"] == 1 && std["inflight"] == 1).then_some(())
        },
    )
    .await;
    let third = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(third.status(), 429);
    assert_eq!(header(&third, "x-sluice-reason"), "queue_dropped");
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"]["reason"], "queue_dropped");
    assert_eq!(body["error"]["tier"], "Standard");

    let first = first.await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-sluice-decision"), "pass");
    let second = second.await.unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "x-sluice-decision"), "queue");
    assert_eq!(header(&second, "x-sluice-reason"), "queue_released");
    let waited: f64 = header(&second, "x-sluice-queue-wait-ms").parse().unwrap();
    assert!(waited > 300.0, "waited {waited} ms for the first to finish");
    assert_eq!(
        sim_stats(&od).await["peak_running"],
        1,
        "capacity 1 held at the backend"
    );

    // Records are made after each response has gone out: wait for both.
    wait_for(Duration::from_secs(3), "both queue records", || async {
        let recent = s.recent("limit=10").await;
        let has = |r: &str| recent.iter().any(|d| d["reason"] == r);
        (has("queue_released") && has("queue_dropped")).then_some(())
    })
    .await;
}

#[tokio::test]
async fn queue_times_out_at_its_deadline() {
    let (_od, _sp, s) = queue_setup(0.3).await;
    let s = std::sync::Arc::new(s);
    let holder = {
        let s = s.clone();
        tokio::spawn(async move {
            s.chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let started = Instant::now();
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
        .await;
    let waited = started.elapsed();
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-sluice-decision"), "queue");
    assert_eq!(header(&r, "x-sluice-reason"), "queue_timed_out");
    assert!(
        waited >= Duration::from_millis(280) && waited < Duration::from_millis(800),
        "{waited:?}"
    );
    assert_eq!(holder.await.unwrap().status(), 200);
    // The holder's slot returns in the logging phase, just after its answer went out.
    wait_for(Duration::from_secs(3), "nothing leaked", || async {
        let std = s.tier("Standard").await;
        ((std["queued"].as_u64(), std["inflight"].as_u64()) == (Some(0), Some(0))).then_some(())
    })
    .await;
}

#[tokio::test]
async fn guaranteed_at_capacity_is_refused_not_queued() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"tiers": {"Guaranteed": {"inflight_capacity": 1}}}),
    );
    let s = std::sync::Arc::new(serve(&cfg).await);
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 600})).await;
    let holder = {
        let s = s.clone();
        tokio::spawn(async move {
            s.chat("support-bot", chat_body("llama-3-70b", Some(5)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = s
        .chat("support-bot", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-sluice-reason"), "tier_at_capacity");
    assert_eq!(holder.await.unwrap().status(), 200);
}

#[tokio::test]
async fn fallback_after_sustained_pressure_and_back_after_recovery() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let small = sim("llama-3-8b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"fallbacks": [{"name": "small", "url": format!("http://{}", small.addr), "model": "llama-3-8b"}]}),
    );
    let s = serve(&cfg).await;
    s.activate_fallback("fallback:small").await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(50)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-decision"), "fallback");
    assert_eq!(header(&r, "x-sluice-reason"), "fallback_sustained_pressure");
    assert_eq!(header(&r, "x-sluice-pool"), "fallback:small");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["model"], "llama-3-8b",
        "model rewritten to the fallback"
    );
    assert_eq!(sim_stats(&small).await["received"], 1);
    // Guaranteed is not fallback-eligible: it stays on the big model.
    let g = s
        .chat("support-bot", chat_body("llama-3-70b", Some(5)))
        .await;
    let g: Value = g.json().await.unwrap();
    assert_eq!(g["model"], "llama-3-70b");

    // Critical while the fallback is active: still served by the fallback, capped, not refused.
    s.set_signal("/admin/pressure", 95.0).await;
    s.wait_tier_state("Standard", "Critical").await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(1000)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-decision"), "fallback");
    assert_eq!(header(&r, "x-sluice-pool"), "fallback:small");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "llama-3-8b");
    assert_eq!(body["usage"]["completion_tokens"], 256, "Standard's cap");
    // With the fallback backend down, Critical rejects again.
    sim_admin(&small, "/admin/health", json!({"healthy": false})).await;
    wait_for(
        Duration::from_secs(5),
        "the fallback to be unusable",
        || async {
            s.status().await["fallback"]["target"]
                .is_null()
                .then_some(())
        },
    )
    .await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(50)))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-sluice-reason"), "reject_pressure_critical");
    assert_eq!(sim_stats(&small).await["received"], 2);
    sim_admin(&small, "/admin/health", json!({"healthy": true})).await;

    // Recovery: the scraped pressure of an idle simulator is ~0.
    s.clear_signal("/admin/pressure").await;
    // `active` already went false while the fallback backend was down; the tracker itself
    // is what must recover.
    wait_for(Duration::from_secs(5), "fallback to recover", || async {
        (s.status().await["fallback"]["sustained_pressure"] == false).then_some(())
    })
    .await;
    s.wait_tier_state("Standard", "Normal").await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(header(&r, "x-sluice-decision"), "pass");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "llama-3-70b");
}
