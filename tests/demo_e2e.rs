//! The foundation issue's "done when", against `sluice demo` itself in the prototype's
//! `thresholds` mode (`SLUICE_POLICY_MODE=thresholds`): pass, reject at 65 while Guaranteed
//! passes, degrade to 256 tokens at 75.

mod common;
use common::*;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Starts the demo on a free port and waits until it is ready, on another port when its own is
/// taken ([`wait_started`]).
async fn start_demo() -> (Proc, String) {
    let log = std::env::temp_dir().join(format!("sluice-demo-e2e-{}.log", std::process::id()));
    for _ in 0..3 {
        let addr = format!("127.0.0.1:{}", free_port());
        let ops = format!("127.0.0.1:{}", free_port());
        let child = Command::new(BIN)
            .args(["demo", "--listen", &addr, "--ops-listen", &ops])
            .env("SLUICE_POLICY_MODE", "thresholds")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut demo = Proc::new(child, addr);
        let ready = format!("http://{ops}/readyz");
        if wait_started(&mut demo, &ready, &log).await {
            return (demo, ops);
        }
    }
    panic!("the demo found its port in use three times");
}

#[tokio::test]
async fn demo_walkthrough() {
    let c = client();
    let (demo, ops) = start_demo().await;
    let chat = |tenant: &'static str| {
        c.post(demo.url("/v1/chat/completions"))
            .header("x-tenant-id", tenant)
            .json(&chat_body("llama-3-70b", Some(400)))
            .send()
    };
    let r = chat("batch-analytics").await.unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len()
            > 10
    );

    let put = |v: f64| {
        c.put(format!("http://{ops}/admin/pressure"))
            .json(&json!({"value": v}))
            .send()
    };
    assert_eq!(put(65.0).await.unwrap().status(), 200);
    let rejected = wait_for(
        Duration::from_secs(8),
        "Best-Effort to be rejected",
        || async {
            let r = chat("batch-analytics").await.ok()?;
            (r.status() == 429).then_some(r)
        },
    )
    .await;
    let body: Value = rejected.json().await.unwrap();
    assert_eq!(body["error"]["type"], "sluice_capacity");
    assert_eq!(body["error"]["code"], "capacity_rejected");
    assert_eq!(chat("support-bot").await.unwrap().status(), 200);

    assert_eq!(put(75.0).await.unwrap().status(), 200);
    let degraded = wait_for(
        Duration::from_secs(8),
        "Standard to be degraded",
        || async {
            let r = chat("coding-assistant").await.ok()?;
            (header(&r, "x-sluice-decision") == "degrade").then_some(r)
        },
    )
    .await;
    let body: Value = degraded.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 256);
}
