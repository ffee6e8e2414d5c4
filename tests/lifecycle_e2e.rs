//! Graceful drain, hot reload and zero-downtime binary upgrade, against real processes.

mod common;
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// These tests signal whole processes and time their exits: run them one at a time so a busy
/// neighbour cannot stretch the timings they assert.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let _serial = SERIAL.lock().await;
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

/// The drain: 20 long streams through a replica with the ledger and Redis admission on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_twenty_streams_with_ledger_and_redis() {
    let _serial = SERIAL.lock().await;
    let od = sim("llama-3-70b", &["--itl-ms", "20", "--max-running", "64"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let schema = create_schema().await;
    let ns = RedisNs::new(&shared_redis_url());
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({
            "server": {"grace_period_seconds": 20},
            "tiers": {"Standard": {"inflight_capacity": 20}},
            "queue": {"max_wait_seconds": 15},
            "database_url": "postgres://postgres@127.0.0.1:5432/test",
            "ledger": {"schema": schema.0, "spool_dir": schema.spool_dir().display().to_string()},
            "redis_url": ns.url,
            "coordination": {"redis_prefix": ns.prefix},
        }),
    );
    let mut s = serve(&cfg).await;
    assert_eq!(s.status().await["coordinator"], "redis");

    let mut streams = Vec::new();
    for _ in 0..20 {
        let r = s.chat("coding-assistant", stream_body(300)).await;
        assert_eq!(r.status(), 200);
        let id = header(&r, "x-request-id").to_string();
        streams.push((id, tokio::spawn(read_stream(r))));
    }
    let url = s.url("/v1/chat/completions");
    let queued = tokio::spawn(async move {
        client()
            .post(url)
            .header("x-tenant-id", "coding-assistant")
            .json(&chat_body("llama-3-70b", Some(5)))
            .send()
            .await
    });
    wait_for(
        Duration::from_secs(5),
        "the 21st request to queue",
        || async { (s.tier("Standard").await["queued"] == 1).then_some(()) },
    )
    .await;
    let sent = Instant::now();
    signal(s.pid(), "-TERM");

    let q = queued.await.unwrap().unwrap();
    assert_eq!(q.status(), 503);
    assert_eq!(header(&q, "x-sluice-reason"), "draining");
    let queued_id = header(&q, "x-request-id").to_string();
    let mut last_stream_end = sent;
    let mut ids = vec![queued_id];
    for (id, reader) in streams {
        let text = reader.await.unwrap();
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream {id} completed"
        );
        last_stream_end = last_stream_end.max(Instant::now());
        ids.push(id);
    }
    let exited = loop {
        if s.proc.child.try_wait().unwrap().is_some() {
            break Instant::now();
        }
        assert!(
            sent.elapsed() < Duration::from_secs(20),
            "exited before the grace ran out"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let after_last = exited.saturating_duration_since(last_stream_end);
    eprintln!(
        "drain: 20 streams done {:.2} s after SIGTERM, process exited {:.2} s after the last one",
        (last_stream_end - sent).as_secs_f64(),
        after_last.as_secs_f64()
    );
    assert!(
        after_last < Duration::from_secs(2),
        "exited right after the last stream, not after the grace"
    );

    // Every request has its row, once; no slot is left held in Redis.
    let rows = row_counts(&schema).await;
    for id in &ids {
        assert_eq!(rows.get(id), Some(&1), "ledger row for {id}");
    }
    assert!(ns.idle(), "no admission slot or queue entry left in Redis");
}

#[tokio::test]
async fn sighup_reloads_tenants_and_keeps_the_old_config_when_invalid() {
    let _serial = SERIAL.lock().await;
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let cfg = config(&[&od.addr], &[&sp.addr]);
    let s = serve(&cfg).await;
    let tier = |r: &reqwest::Response| header(r, "x-sluice-tier").to_string();
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(2)))
        .await;
    assert_eq!(tier(&r), "Best-Effort");

    // Traffic keeps flowing through both reloads; not one request may fail.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, url) = (stop.clone(), s.url("/v1/chat/completions"));
        load.push(tokio::spawn(async move {
            let (c, mut statuses) = (client(), Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let r = c
                    .post(&url)
                    .header("x-tenant-id", "batch-analytics")
                    .json(&chat_body("llama-3-70b", Some(2)))
                    .send()
                    .await;
                statuses.push(r.map(|r| r.status().as_u16()).unwrap_or(0));
            }
            statuses
        }));
    }

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
    let log = s
        .log_when("the refusal to be logged", |log| {
            log.contains("config_reload_refused")
        })
        .await;
    assert!(
        log.contains("tiers.Standard.inflight_capacity"),
        "names the key: {log}"
    );
    let r = s
        .chat("batch-analytics", chat_body("llama-3-70b", Some(2)))
        .await;
    assert_eq!(tier(&r), "Guaranteed", "the previous config stays in force");
    stop.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for l in load {
        statuses.extend(l.await.unwrap());
    }
    assert!(statuses.len() > 4, "load ran ({} requests)", statuses.len());
    assert!(
        statuses.iter().all(|&st| st == 200),
        "a request failed across a reload: {statuses:?}"
    );
}

/// One request of the load generator: when it started and ended, and how it went.
struct Outcome {
    start: Instant,
    end: Instant,
    stream: bool,
    failure: Option<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_hands_over_listeners_without_failing_a_request() {
    let _serial = SERIAL.lock().await;
    let od = sim("llama-3-70b", &["--itl-ms", "10", "--max-running", "256"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(&mut cfg, json!({"server": {"grace_period_seconds": 15}}));
    let old = serve(&cfg).await;
    let path = old.dir.join("sluice.yaml");
    let url = old.url("/v1/chat/completions");

    // ~50 concurrent clients; one in four holds a long stream (300 tokens, ~3.5 s).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..48 {
        let (stop, url) = (stop.clone(), url.clone());
        workers.push(tokio::spawn(async move {
            let c = client();
            let mut outcomes = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let stream = i % 4 == 0;
                let body = if stream {
                    stream_body(300)
                } else {
                    chat_body("llama-3-70b", Some(5))
                };
                let start = Instant::now();
                let sent = c
                    .post(&url)
                    .header("x-tenant-id", "support-bot")
                    .json(&body)
                    .send()
                    .await;
                let failure = match sent {
                    Ok(r) if r.status() == 200 || r.status() == 429 => {
                        let text = r.text().await.unwrap_or_default();
                        (stream && !text.trim_end().ends_with("data: [DONE]"))
                            .then(|| format!("truncated stream: {} bytes", text.len()))
                    }
                    Ok(r) => Some(format!("status {}", r.status())),
                    Err(e) => Some(format!("error {e}")),
                };
                outcomes.push(Outcome {
                    start,
                    end: Instant::now(),
                    stream,
                    failure,
                });
            }
            outcomes
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let log = std::fs::File::create(old.dir.join("new.log")).unwrap();
    // Killed on drop, so a failing assertion cannot leave it running.
    let _new = Proc::new(
        Command::new(BIN)
            .args(["serve", "-u", "--config"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
        old.addr.clone(),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let quit = Instant::now();
    signal(old.pid(), "-QUIT");
    let mut old = old;
    let old_exit = loop {
        if old.proc.child.try_wait().unwrap().is_some() {
            break Instant::now();
        }
        assert!(
            quit.elapsed() < Duration::from_secs(20),
            "the old process drained and exited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = Vec::new();
    for w in workers {
        outcomes.extend(w.await.unwrap());
    }
    let failures: Vec<&String> = outcomes.iter().filter_map(|o| o.failure.as_ref()).collect();
    let during = outcomes
        .iter()
        .filter(|o| o.end > quit && o.start < old_exit)
        .count();
    let carried = outcomes
        .iter()
        .filter(|o| o.stream && o.start < quit && o.end > quit)
        .map(|o| o.end - o.start)
        .max()
        .unwrap_or_default();
    eprintln!(
        "upgrade: {} requests, {} during the handoff (SIGQUIT to old exit, {:.1} s), {} failed; \
         longest stream carried across: {:.2} s",
        outcomes.len(),
        during,
        (old_exit - quit).as_secs_f64(),
        failures.len(),
        carried.as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failures, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        during > 100,
        "requests kept completing during the handoff ({during})"
    );
    assert!(
        carried > Duration::from_secs(1),
        "a long stream crossed the handoff"
    );
    let r = client().get(old.ops_url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200, "the new process serves");
}
