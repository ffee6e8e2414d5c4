//! Identity, admin authentication and bad input: each gets a clear answer and nothing is lost.

mod common;
use common::*;
use serde_json::{json, Value};

fn sha256_hex(key: &str) -> String {
    sluice_config::tenancy::hash_key(key)
}

#[tokio::test]
async fn unknown_tenants_get_the_default_tier_or_401() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    let r = s.chat("who-knows", chat_body("llama-3-70b", Some(3))).await;
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-sluice-tier")),
        (200, "Best-Effort")
    );
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .json(&chat_body("llama-3-70b", Some(3)))
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&r, "x-sluice-tier"),
        "Best-Effort",
        "no tenant header at all"
    );

    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(&mut cfg, json!({"auth": {"unknown_tenant": "reject"}}));
    let strict = serve(&cfg).await;
    let r = strict
        .chat("who-knows", chat_body("llama-3-70b", Some(3)))
        .await;
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["reason"], "unknown_tenant");
    let r = strict
        .chat("bad tenant", chat_body("llama-3-70b", Some(3)))
        .await;
    assert_eq!(r.status(), 400, "a malformed X-Tenant-ID is refused");
}

#[tokio::test]
async fn api_keys_decide_the_tenant_and_cannot_be_bypassed() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({
            "api_keys": [{"tenant": "batch-analytics", "sha256": sha256_hex("sk-batch")}],
            "auth": {"require_api_key": true},
        }),
    );
    let s = serve(&cfg).await;
    let call = |key: Option<&str>, tenant: &str| {
        let mut req = client()
            .post(s.url("/v1/chat/completions"))
            .header("x-tenant-id", tenant)
            .json(&chat_body("llama-3-70b", Some(3)));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send()
    };
    let r = call(Some("sk-batch"), "support-bot").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-sluice-tier"),
        "Best-Effort",
        "X-Tenant-ID cannot promote a key's tenant"
    );
    let r = call(Some("sk-wrong"), "support-bot").await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(header(&r, "x-sluice-reason"), "invalid_api_key");
    let r = call(None, "support-bot").await.unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["reason"], "missing_api_key");
    assert_eq!(
        sim_stats(&od).await["received"].as_u64().unwrap()
            + sim_stats(&sp).await["received"].as_u64().unwrap(),
        1
    );
}

#[tokio::test]
async fn admin_endpoints_need_the_admin_token() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"api_keys": [{"tenant": "support-bot", "sha256": sha256_hex("sk-tenant")}]}),
    );
    let s = serve_with(&cfg, &[("SLUICE_ADMIN_TOKEN", "s3cret")], true).await;
    let put = |token: Option<&str>, body: Value| {
        let mut req = client().put(s.ops_url("/admin/pressure")).json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    assert_eq!(put(None, json!({"value": 50})).await.unwrap().status(), 401);
    assert_eq!(
        put(Some("sk-tenant"), json!({"value": 50}))
            .await
            .unwrap()
            .status(),
        401,
        "a tenant key is not an admin token"
    );
    assert_eq!(
        put(Some("s3cret"), json!({"value": 50}))
            .await
            .unwrap()
            .status(),
        200
    );
    let r = put(Some("s3cret"), json!({"value": 150})).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("outside"),
        "{body}"
    );
    assert_eq!(
        put(Some("s3cret"), json!({"v": 1})).await.unwrap().status(),
        400
    );
    let st = s.status().await;
    assert_eq!(st["signals"]["on-demand"]["pressure"]["value"], 50.0);
    assert_eq!(st["signals"]["on-demand"]["pressure"]["source"], "admin");
    let r = client()
        .delete(s.ops_url("/admin/pressure"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn oversized_and_malformed_bodies() {
    let od = sim(
        "llama-3-70b",
        &["--kv-tokens", "100000", "--prefill-us-per-token", "0"],
    )
    .await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(&mut cfg, json!({"limits": {"max_body_bytes": 300000}}));
    let s = serve(&cfg).await;
    let post = |tenant: &'static str, body: Vec<u8>| {
        client()
            .post(s.url("/v1/chat/completions"))
            .header("x-tenant-id", tenant)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = post("support-bot", vec![b'x'; 400_000]).await.unwrap();
    assert_eq!(r.status(), 413);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "body_too_large");

    // Not JSON and nothing to rewrite: forwarded untouched, vLLM answers it.
    let r = post("coding-assistant", b"{not json".to_vec())
        .await
        .unwrap();
    assert_eq!(header(&r, "x-sluice-reason"), "body_not_json_forwarded");
    assert_eq!(r.status(), 400, "vLLM's own 400 for invalid JSON");
    let received = sim_stats(&od).await["received"].as_u64().unwrap();

    // Not JSON but the decision must rewrite it: refused by Sluice, vLLM never sees it.
    s.set_signal("/admin/pressure", 75.0).await;
    s.wait_tier_state("Standard", "Elevated").await;
    let r = post("coding-assistant", b"{not json".to_vec())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_json");
    assert_eq!(sim_stats(&od).await["received"].as_u64().unwrap(), received);

    // A prompt of ~240 KiB (several reads of the body) is read whole, capped and sent with
    // its new length.
    let big = "lorem ipsum ".repeat(20_000);
    let body = json!({"model": "llama-3-70b", "messages": [{"role": "user", "content": big}], "max_tokens": 5000});
    let r = post("coding-assistant", serde_json::to_vec(&body).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let stats = sim_stats(&od).await;
    let last = stats["recent"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["max_tokens"], 256);
}

#[test]
fn check_names_file_key_and_reason() {
    let (dir, path) = write_config(
        &json!({"tiers": {"Standard": {"thresholds": {"pressure": {"elevated_at": 95, "critical_at": 90}}}}}),
    );
    let out = sluice_check(&path);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("tiers.Standard.thresholds.pressure"), "{err}");
    assert!(err.contains("above critical_at"), "{err}");

    std::fs::write(
        &path,
        "pools:\n  on-demand:\n    backends: [\"127.0.0.1:8001\"]\n  spot: {backends: 3}\n",
    )
    .unwrap();
    let out = sluice_check(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("pools.spot.backends"),
        "{err}"
    );

    // A brownout cap that is not below the tier's cap (the default 256 here) is refused.
    std::fs::write(&path, "tiers:\n  Standard:\n    brownout_max_tokens: 300\n").unwrap();
    let out = sluice_check(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("tiers.Standard.brownout_max_tokens")
            && err.contains("max_tokens_cap (256)"),
        "{err}"
    );

    let out = std::process::Command::new(BIN)
        .args(["check", "--config", "conf/sluice.yaml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the shipped config is valid: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}
