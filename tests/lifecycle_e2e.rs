//! Graceful drain, hot reload and zero-downtime binary upgrade, against real processes.

mod common;
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

fn stream_body(tokens: u64) -> Value {
    let mut b = chat_body("llama-3-70b", Some(tokens));
    b["stream"] = json!(true);
    b
}

async fn read_stream(r: reqwest::Response) -> String {
    let mut text = String::new();
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        match c {
            Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
            Err(e) => {
                text.push_str(&format!("<error: {e}>"));
                break;
            }
        }
    }
    text
}

#[tokio::test]
async fn sigterm_drains_streams_exactly_and_refuses_the_queue() {
    let od = sim("llama-3-70b", &["--itl-ms", "30"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"server": {"grace_period_seconds": 20}, "tiers": {"Standard": {"inflight_capacity": 1}}, "queue": {"max_wait_seconds": 10}}),
    );
    let mut s = serve(&cfg).await;
    let stream = s.chat("coding-assistant", stream_body(60)).await;
    assert_eq!(stream.status(), 200);
    let reader = tokio::spawn(read_stream(stream));
    let s_url = s.url("/v1/chat/completions");
    let queued = tokio::spawn(async move {
        client()
            .post(s_url)
            .header("x-tenant-id", "coding-assistant")
            .json(&chat_body("llama-3-70b", Some(5)))
            .send()
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    signal(s.pid(), "-TERM");

    let q = queued.await.unwrap().unwrap();
    assert_eq!(q.status(), 503, "a queued request is told at once");
    assert_eq!(header(&q, "x-sluice-reason"), "draining");
    let text = reader.await.unwrap();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the in-flight stream finished: {text}"
    );
    let status = tokio::task::spawn_blocking(move || {
        let start = Instant::now();
        loop {
            if let Some(st) = s.proc.child.try_wait().unwrap() {
                return (st, start);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    let exited_after = sent.elapsed();
    assert!(status.0.success(), "clean exit");
    assert!(
        exited_after < Duration::from_secs(6),
        "exited {exited_after:?} after SIGTERM, not after the 20 s grace"
    );
}

#[tokio::test]
async fn sighup_reloads_tenants_and_keeps_the_old_config_when_invalid() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let cfg = config(&[&od.addr], &[&sp.addr]);
    let s = serve(&cfg).await;
    let tier = |r: &reqwest::Response| header(r, "x-sluice-tier").to_string();
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(2)))
        .await;
    assert_eq!(tier(&r), "Best-Effort");

    let path = s.dir.join("sluice.yaml");
    let mut promoted = cfg.clone();
    merge(
        &mut promoted,
        json!({"tenants": {"batch-analytics": "Guaranteed"}}),
    );
    let mut text = serde_yaml::to_string(&promoted).unwrap();
    // keep the harness's socket paths
    let original = std::fs::read_to_string(&path).unwrap();
    let server_block: Value = serde_yaml::from_str::<Value>(&original).unwrap()["server"].clone();
    merge(&mut promoted, json!({"server": server_block}));
    text = serde_yaml::to_string(&promoted).unwrap_or(text);
    std::fs::write(&path, text).unwrap();
    signal(s.pid(), "-HUP");
    wait_for(Duration::from_secs(5), "the reload to apply", || async {
        let r = s
            .chat("batch-analytics", chat_body("llama-3-70b", Some(2)))
            .await;
        (tier(&r) == "Guaranteed").then_some(())
    })
    .await;

    std::fs::write(&path, "tiers:\n  Standard:\n    inflight_capacity: lots\n").unwrap();
    signal(s.pid(), "-HUP");
    wait_for(
        Duration::from_secs(5),
        "the refusal to be logged",
        || async { s.log().contains("config_reload_refused").then_some(()) },
    )
    .await;
    let log = s.log();
    assert!(
        log.contains("tiers.Standard.inflight_capacity"),
        "names the key: {log}"
    );
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(2)))
        .await;
    assert_eq!(tier(&r), "Guaranteed", "the previous config stays in force");
}

#[tokio::test]
async fn upgrade_hands_over_listeners_without_failing_a_request() {
    let od = sim("llama-3-70b", &["--itl-ms", "10"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(&mut cfg, json!({"server": {"grace_period_seconds": 15}}));
    let old = serve(&cfg).await;
    let path = old.dir.join("sluice.yaml");
    let url = old.url("/v1/chat/completions");

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for i in 0..24 {
        let (stop, ok, url) = (stop.clone(), ok.clone(), url.clone());
        workers.push(tokio::spawn(async move {
            let c = client();
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let body = if i % 4 == 0 {
                    stream_body(40)
                } else {
                    chat_body("llama-3-70b", Some(5))
                };
                match c
                    .post(&url)
                    .header("x-tenant-id", "support-bot")
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 200 => {
                        let text = r.text().await.unwrap_or_default();
                        if i % 4 == 0 && !text.trim_end().ends_with("data: [DONE]") {
                            failures.push(format!("truncated stream: {text}"));
                        } else {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok(r) => failures.push(format!("status {}", r.status())),
                    Err(e) => failures.push(format!("error {e}")),
                }
            }
            failures
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let log = std::fs::File::create(old.dir.join("new.log")).unwrap();
    let mut new = Command::new(BIN)
        .args(["serve", "-u", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(old.pid(), "-QUIT");
    let before = ok.load(Ordering::Relaxed);
    // The old process keeps accepting for 5 s, then drains; traffic must flow throughout.
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    let after = ok.load(Ordering::Relaxed);
    assert!(
        failures.is_empty(),
        "{} failures, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        after > before + 50,
        "requests kept completing during the handoff ({before} → {after})"
    );
    let mut old = old;
    let exited = old.proc.child.try_wait().unwrap();
    assert!(exited.is_some(), "the old process drained and exited");
    let r = client().get(old.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200, "the new process serves");
    let _ = new.kill();
    let _ = new.wait();
}
