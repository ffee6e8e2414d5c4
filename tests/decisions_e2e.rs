//! Each decision of the intervention ladder, over real HTTP, with simulator backends.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::test]
async fn pass_reject_and_degrade_as_pressure_rises() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;

    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(20)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-decision"), "pass");
    assert_eq!(header(&r, "x-sluice-tier"), "Best-Effort");
    assert_eq!(header(&r, "x-sluice-pool"), "spot");
    assert!(!header(&r, "x-request-id").is_empty());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 20);

    s.set_signal("/admin/pressure", 65.0).await;
    s.wait_tier_state("Best-Effort", "Critical").await;
    let before = sim_stats(&sp).await["received"].as_u64().unwrap();
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(20)))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-sluice-decision"), "reject");
    assert_eq!(header(&r, "x-sluice-reason"), "reject_pressure_critical");
    assert!(header(&r, "retry-after").parse::<u64>().unwrap() >= 1);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body,
        json!({"error": {
            "type": "sluice_capacity",
            "code": "capacity_rejected",
            "message": "Best-Effort request rejected by Sluice: KV-cache pressure put the tier in Critical.",
            "reason": "reject_pressure_critical",
            "tier": "Best-Effort",
            "pressure": 65.0,
            "queue_depth": 0.0,
            "sla_violation_rate": null,
        }})
    );
    let after = sim_stats(&sp).await["received"].as_u64().unwrap();
    let after_od = sim_stats(&od).await["received"].as_u64().unwrap();
    assert_eq!(before, after, "a rejected request never reaches vLLM");
    assert_eq!(after_od, 0);

    let r = s
        .chat("support-bot", chat_body("llama-3-70b", Some(600)))
        .await;
    assert_eq!(r.status(), 200, "Guaranteed still passes at 65");
    assert_eq!(header(&r, "x-sluice-decision"), "pass");

    s.set_signal("/admin/pressure", 75.0).await;
    s.wait_tier_state("Standard", "Elevated").await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(1000)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-decision"), "degrade");
    assert_eq!(header(&r, "x-sluice-reason"), "degrade_pressure_elevated");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["usage"]["completion_tokens"], 256,
        "capped to the Standard cap"
    );
    let seen = sim_stats(&od).await;
    assert_eq!(
        seen["recent"].as_array().unwrap().last().unwrap()["max_tokens"],
        256
    );

    // A request already under the cap reaches vLLM byte for byte.
    let raw = r#"{"model":"llama-3-70b", "messages":[{"role":"user","content":"hi"}],  "max_tokens": 12}"#;
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .header("x-tenant-id", "coding-assistant")
        .header("content-type", "application/json")
        .body(raw)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = sim_stats(&od).await;
    assert_eq!(
        seen["recent"].as_array().unwrap().last().unwrap()["content_length"],
        raw.len().to_string(),
        "the original Content-Length (and body) reached the backend"
    );
}

#[tokio::test]
async fn metrics_and_recent_decisions_describe_what_happened() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    for _ in 0..3 {
        assert_eq!(
            s.chat("support-bot", chat_body("llama-3-70b", Some(4)))
                .await
                .status(),
            200
        );
    }
    // Sluice answers the list itself once every pool's models are known (until then it is
    // proxied); ask only then, so the decision counted is the one this test is about.
    wait_for(
        Duration::from_secs(5),
        "every pool's models known",
        || async { (s.status().await["routes"]["complete"] == true).then_some(()) },
    )
    .await;
    let _ = client()
        .get(s.url("/v1/models"))
        .header("x-tenant-id", "support-bot")
        .send()
        .await
        .unwrap();
    // Metrics and records are written after each response has gone out: wait for all four.
    wait_for(Duration::from_secs(3), "four decision records", || async {
        (s.recent("limit=4").await.len() == 4).then_some(())
    })
    .await;
    let m = s.metrics().await;
    assert!(
        m.contains(r#"sluice_decisions_total{decision="pass",reason="below_tier_pressure_threshold",tier="Guaranteed"} 3"#),
        "{m}"
    );
    // The model list is the fleet's, answered by Sluice itself.
    assert!(m.contains(
        r#"sluice_decisions_total{decision="pass",reason="models_listed",tier="Guaranteed"} 1"#
    ));
    assert!(m.contains("sluice_proxy_overhead_seconds_bucket{tier=\"Guaranteed\",le=\"0.0001\"}"));
    // The three proxied requests; the model list never reached a backend.
    assert!(
        m.contains(
            "sluice_request_duration_seconds_count{decision=\"pass\",tier=\"Guaranteed\"} 3"
        ),
        "{m}"
    );
    assert!(m.contains("sluice_backend_healthy{backend=\""));
    assert!(m.contains("sluice_tier_state{tier=\"Standard\"} 0"));

    let recent = s.recent("limit=2").await;
    let d = &recent;
    assert_eq!(d.len(), 2);
    assert_eq!(d[0]["path"], "/v1/models", "newest first");
    assert_eq!(d[1]["completion_tokens"], 4);
    assert_eq!(d[1]["tenant"], "support-bot");
    assert!(d[1]["overhead_us"].as_f64().unwrap() > 0.0);
    let models_line = |l: &str| l.contains("\"path\":\"/v1/models\"");
    let log = s
        .log_when("a JSON log line per request", |log| {
            log.lines().any(models_line)
        })
        .await;
    let line = log.lines().find(|l| models_line(l)).unwrap();
    let parsed: Value = serde_json::from_str(line).unwrap();
    assert_eq!(parsed["reason"], "models_listed");
}

#[tokio::test]
async fn tenant_label_is_opt_in_and_capped() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let plain = serve(&config(&[&od.addr], &[&sp.addr])).await;
    plain
        .chat("support-bot", chat_body("llama-3-70b", Some(2)))
        .await;
    assert!(
        !plain
            .metrics()
            .await
            .contains("sluice_tenant_requests_total{"),
        "off by default"
    );

    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"metrics": {"tenant_label": true, "max_tenants": 2}}),
    );
    let s = serve(&cfg).await;
    for tenant in [
        "support-bot",
        "coding-assistant",
        "tenant-3",
        "tenant-4",
        "support-bot",
    ] {
        assert_eq!(
            s.chat(tenant, chat_body("llama-3-70b", Some(2)))
                .await
                .status(),
            200
        );
    }
    let m = s.metrics().await;
    let tenants: std::collections::BTreeSet<&str> = m
        .lines()
        .filter(|l| l.starts_with("sluice_tenant_requests_total{"))
        .filter_map(|l| l.split("tenant=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(
        tenants.into_iter().collect::<Vec<_>>(),
        ["coding-assistant", "other", "support-bot"]
    );
    assert!(
        m.contains(r#"sluice_sla_requests_total{outcome="met",tier="Guaranteed"} 2"#),
        "{m}"
    );
}
