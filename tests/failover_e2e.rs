//! Failover before the first byte, over real HTTP against `sluice serve` and `sluice sim`
//! replicas: a replica SIGKILLed under open-loop load and restarted on its port, then its twin
//! answering 503, cost no request but the streams the dead replica had started; a fleet-wide
//! 503 is not multiplied past the retry budget; a body over 64 KiB is resent whole; a stream cut
//! mid-answer is never retried. The tests take turns (one lock): the first one's timing is the
//! point, and a loaded 2-core machine running them side by side would blur it.

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MODEL: &str = "llama-3-70b";

/// One pool of `backends` with the shipped health check (1 s, two failures to mark a replica
/// down), so passive ejection, not the health check, is what acts first.
fn one_pool(backends: &[&str], extra: Value) -> Value {
    let mut cfg = config(&[], &[]);
    let mut pool = json!({
        "backends": backends,
        "health_check": {"path": "/health", "interval_ms": 1000, "timeout_ms": 1000,
                         "consecutive_success": 1, "consecutive_failure": 2},
    });
    merge(&mut pool, extra);
    cfg["pools"] = json!({ "on-demand": pool });
    cfg
}

/// What one request of the load got.
#[derive(Debug, Clone)]
struct Outcome {
    index: usize,
    stream: bool,
    /// When it was sent, from the start of the load.
    sent: Duration,
    status: u16,
    /// A complete answer: JSON with choices, or a stream ending in `[DONE]`.
    complete: bool,
    /// SSE events received (streams).
    events: usize,
    /// Role chunks received: more than one would be a second attempt spliced into the stream.
    starts: usize,
    error: Option<String>,
    /// `x-sluice-retry-denied`: why a failed attempt's answer was not sent elsewhere.
    retry_denied: Option<String>,
}

fn body(index: usize, stream: bool, max_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": format!("request {index}: tell me about sluices")}],
    })
}

async fn send(
    c: reqwest::Client,
    url: String,
    index: usize,
    stream: bool,
    max_tokens: u64,
    t0: Instant,
) -> Outcome {
    let tenant = if index % 4 < 2 {
        "support-bot"
    } else {
        "coding-assistant"
    };
    let sent = t0.elapsed();
    let mut out = Outcome {
        index,
        stream,
        sent,
        status: 0,
        complete: false,
        events: 0,
        starts: 0,
        error: None,
        retry_denied: None,
    };
    let r = c
        .post(&url)
        .header("x-tenant-id", tenant)
        .header("x-request-id", format!("fo-{index}"))
        .json(&body(index, stream, max_tokens))
        .send()
        .await;
    let mut r = match r {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    out.status = r.status().as_u16();
    out.retry_denied = r
        .headers()
        .get("x-sluice-retry-denied")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut text = Vec::new();
    loop {
        match r.chunk().await {
            Ok(Some(b)) => text.extend_from_slice(&b),
            Ok(None) => break,
            Err(e) => {
                out.error = Some(e.to_string());
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&text);
    if stream {
        out.events = text.matches("data:").count();
        out.starts = text.matches("\"role\":\"assistant\"").count();
        out.complete = out.error.is_none() && text.ends_with("data: [DONE]\n\n");
    } else {
        out.complete = out.error.is_none()
            && serde_json::from_str::<Value>(&text)
                .is_ok_and(|v| v["choices"][0]["message"].is_object());
    }
    out
}

/// Sends `n` requests at `per_sec`, every other one streamed, running `at(i)` before request
/// `i` (what the test does to the fleet then); returns every outcome.
async fn open_loop<F, Fut>(
    s: &Sluice,
    n: usize,
    per_sec: u32,
    max_tokens: u64,
    t0: Instant,
    mut at: F,
) -> Vec<Outcome>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let c = client();
    let url = s.url("/v1/chat/completions");
    let mut tick = tokio::time::interval(Duration::from_secs(1) / per_sec);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        tick.tick().await;
        at(i).await;
        tasks.push(tokio::spawn(send(
            c.clone(),
            url.clone(),
            i,
            i % 2 == 1,
            max_tokens,
            t0,
        )));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// One pool's entry of `/status`.
fn pool_status(status: &Value) -> Value {
    status["pools"][0].clone()
}

fn backend_status(status: &Value, addr: &str) -> Value {
    pool_status(status)["backends"]
        .as_array()
        .and_then(|bs| bs.iter().find(|b| b["backend"] == addr).cloned())
        .unwrap_or(Value::Null)
}

/// A backend's state changes as `/status` showed them, each with when it was first seen.
#[derive(Default)]
struct Timeline(Vec<(Duration, String, String)>);

impl Timeline {
    fn first(&self, backend: &str, state: &str, after: Duration) -> Option<Duration> {
        self.0
            .iter()
            .find(|(t, b, s)| *t >= after && b == backend && s.starts_with(state))
            .map(|(t, _, _)| *t)
    }
}

/// Polls `/status` every 100 ms until `stop`, noting each backend's state when it changes:
/// `in`, `ejected <cause>`, `down` (health check) or `ejected+down`.
fn watch(
    ops: String,
    backends: Vec<String>,
    t0: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Timeline> {
    tokio::spawn(async move {
        let c = client();
        let mut last: HashMap<String, String> = HashMap::new();
        let mut tl = Timeline::default();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(r) = c.get(format!("http://{ops}/status")).send().await {
                if let Ok(st) = r.json::<Value>().await {
                    for b in &backends {
                        let bs = backend_status(&st, b);
                        let state = match (bs["ejected"].is_object(), bs["healthy"] == true) {
                            (false, true) => "in".to_string(),
                            (true, true) => format!("ejected {}", bs["ejected"]["cause"]),
                            (true, false) => format!("ejected+down {}", bs["ejected"]["cause"]),
                            (false, false) => "down".to_string(),
                        };
                        if last.get(b) != Some(&state) {
                            tl.0.push((t0.elapsed(), b.clone(), state.clone()));
                            last.insert(b.clone(), state);
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tl
    })
}

/// Every record of `/decisions/recent`, by request id (the newest of a reused id).
async fn records(s: &Sluice) -> HashMap<String, Value> {
    s.recent("limit=1000")
        .await
        .into_iter()
        .rev()
        .map(|r| (r["request_id"].as_str().unwrap_or_default().to_string(), r))
        .collect()
}

/// The `upstream_retry` events of Sluice's log, by request id, in order: one per retry, naming
/// the replica that failed and why.
fn retries_by_request(s: &Sluice) -> HashMap<String, Vec<Value>> {
    let mut out: HashMap<String, Vec<Value>> = HashMap::new();
    for line in s.log().lines() {
        if !line.contains("upstream_retry") {
            continue;
        }
        // A log record: the event is its message, JSON in a string.
        let Some(v) = serde_json::from_str::<Value>(line)
            .ok()
            .and_then(|r| serde_json::from_str::<Value>(r["message"].as_str()?).ok())
            .filter(|v| v["event"] == "upstream_retry")
        else {
            continue;
        };
        let id = v["request_id"].as_str().unwrap_or_default().to_string();
        out.entry(id).or_default().push(v);
    }
    out
}

/// Waits until the log holds `n` retry events (lines reach the log shortly after the request).
async fn retries_logged(s: &Sluice, n: u64) -> HashMap<String, Vec<Value>> {
    wait_for(Duration::from_secs(5), "every retry in the log", || async {
        let r = retries_by_request(s);
        (r.values().map(|v| v.len() as u64).sum::<u64>() >= n).then_some(r)
    })
    .await
}

fn sum(map: &Value) -> u64 {
    map.as_object()
        .map_or(0, |m| m.values().filter_map(Value::as_u64).sum())
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Starts `sluice sim` on `addr` again (the port of a replica that died).
async fn restart_sim(addr: &str) -> Proc {
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(["sim", "--listen", addr, "--model", MODEL])
        .env("RUST_LOG", "warn");
    let mut p = Proc::spawn("sim (restarted)", &mut cmd, addr.to_string(), None).unwrap();
    p.wait_ok("/health", Duration::from_secs(10)).await.unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_dies_or_answers_503_costs_no_request() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let a = sim(MODEL, &[]).await;
    let b = sim(MODEL, &[]).await;
    let (a_addr, b_addr) = (a.addr.clone(), b.addr.clone());
    let s = serve(&one_pool(&[&a_addr, &b_addr], json!({}))).await;

    // 20 req/s for 20 s, every other one streamed, 48-token answers (~70 ms each). A is
    // SIGKILLed at 4 s and restarted on its port at 8 s; B answers 503 (its /health too) from
    // 12 s to 18 s.
    let (n, per_sec) = (400, 20);
    let (kill_at, restart_at, sick_at, well_at) = (80, 160, 240, 360);
    let t0 = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let timeline = watch(
        s.ops.clone(),
        vec![a_addr.clone(), b_addr.clone()],
        t0,
        Arc::clone(&stop),
    );
    let a = Arc::new(Mutex::new(Some(a)));
    let restarted: Arc<Mutex<Option<tokio::task::JoinHandle<Proc>>>> = Default::default();
    let marks = Arc::new(Mutex::new(HashMap::<&str, Duration>::new()));
    let outcomes = open_loop(&s, n, per_sec, 48, t0, |i| {
        let (a, restarted, marks) = (Arc::clone(&a), Arc::clone(&restarted), Arc::clone(&marks));
        let (a_addr, b) = (a_addr.clone(), &b);
        async move {
            let mark = |what| {
                marks.lock().unwrap().insert(what, t0.elapsed());
            };
            if i == kill_at {
                if let Some(mut p) = a.lock().unwrap().take() {
                    p.child.kill().unwrap();
                    p.child.wait().unwrap();
                }
                mark("kill");
            } else if i == restart_at {
                mark("restart");
                *restarted.lock().unwrap() =
                    Some(tokio::spawn(async move { restart_sim(&a_addr).await }));
            } else if i == sick_at {
                sim_admin(b, "/admin/fail", json!({"mode": "unavailable"})).await;
                mark("sick");
            } else if i == well_at {
                sim_admin(b, "/admin/fail", json!({"mode": "none"})).await;
                mark("well");
            }
        }
    })
    .await;
    let restarted = restarted.lock().unwrap().take().unwrap();
    let a = restarted.await.unwrap();
    let marks = marks.lock().unwrap().clone();

    // Both replicas back in selection: B once a health check has passed after its outage.
    let back = wait_for(Duration::from_secs(15), "both replicas back in", || async {
        let st = s.status().await;
        [&a_addr, &b_addr]
            .iter()
            .all(|addr| {
                let bs = backend_status(&st, addr);
                bs["healthy"] == true && bs["ejected"].is_null()
            })
            .then(|| t0.elapsed())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let timeline = timeline.await.unwrap();
    let records = records(&s).await;
    let st = s.status().await;
    let pool = pool_status(&st);

    // The only failures: streams the killed replica had started answering (head sent, so no
    // retry), cut when it died.
    let retries = sum(&pool["retries"]);
    let retry_log = retries_logged(&s, retries).await;
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.complete).collect();
    let kill = marks["kill"];
    let mut cut = 0;
    for o in &failed {
        let id = format!("fo-{}", o.index);
        let rec = &records[&id];
        let cut_by_the_kill = o.stream
            && o.status == 200
            && rec["backend"] == a_addr.as_str()
            && !retry_log.contains_key(&id)
            && o.sent <= kill + Duration::from_millis(100)
            && o.sent + Duration::from_secs(2) >= kill;
        assert!(
            cut_by_the_kill,
            "a request failed that was not a stream the killed replica had started: {o:?} {rec}"
        );
        cut += 1;
    }
    assert!(cut <= 6, "{cut} streams cut");
    // No retry once a byte went out: every stream has one start.
    for o in outcomes.iter().filter(|o| o.stream) {
        assert!(o.starts <= 1, "two answers spliced in one stream: {o:?}");
    }
    // Retries: one logged event each, each request's to replicas it had not tried, well within
    // the budget (20 % of requests).
    let logged: u64 = retry_log.values().map(|v| v.len() as u64).sum();
    assert_eq!(logged, retries, "{pool}");
    assert!(retries > 0, "the kill and the 503s were retried: {pool}");
    assert!(
        retries * 5 <= n as u64,
        "{retries} retries for {n} requests"
    );
    assert_eq!(pool["retries_denied"]["budget"], 0, "{pool}");
    for (id, events) in &retry_log {
        let Some(rec) = records.get(id) else { continue };
        let tried: Vec<&str> = events
            .iter()
            .filter_map(|e| e["backend"].as_str())
            .collect();
        let mut distinct = tried.clone();
        distinct.dedup();
        assert!(
            distinct.len() == tried.len() && !tried.iter().any(|t| rec["backend"] == *t),
            "a retry went back to a replica it had tried: {events:?} {rec}"
        );
        assert_eq!(rec["status"], 200, "a retried request was answered: {rec}");
    }
    // B was ejected for its 503s while sick, and is back in after its health check passed.
    let sick = marks["sick"];
    let b_out = timeline
        .first(&b_addr, "ejected", sick)
        .expect("B ejected for answering 503");
    assert!(b_out <= marks["well"], "B ejected at {b_out:?}");
    assert!(pool["ejections"]["5xx"].as_u64() >= Some(1), "{pool}");
    let b_in = timeline
        .first(&b_addr, "in", b_out)
        .expect("B back in selection");
    // A was out of selection (ejected, or marked down by its checks) after the kill and back
    // after its restart.
    let a_out = timeline
        .0
        .iter()
        .find(|(t, addr, state)| *t >= kill && *addr == a_addr && state != "in")
        .cloned()
        .expect("A out of selection after the kill");
    let a_in = timeline
        .first(&a_addr, "in", a_out.0)
        .expect("A back in selection");

    // B takes requests again (prefix affinity may home the first few new heads on A).
    let before = sim_stats(&b).await["received"].as_u64().unwrap();
    let c = client();
    let mut after = before;
    for i in 0..100 {
        let r = c
            .post(s.url("/v1/chat/completions"))
            .header("x-tenant-id", "support-bot")
            .json(&body(10_000 + i, false, 8))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        after = sim_stats(&b).await["received"].as_u64().unwrap();
        if after > before {
            break;
        }
    }
    assert!(
        after > before,
        "B got nothing of 100 requests after it came back"
    );
    drop(a);

    let cut_events: Vec<usize> = failed.iter().map(|o| o.events).collect();
    println!(
        "failover figures: {n} requests at {per_sec}/s, {} failed ({cut} streams cut by the kill at {}, \
         SSE events each got {cut_events:?}); \
         retries {} (by cause {}), budget {} (denied {}); A out at {} ({}), in at {}; \
         B sick at {}, ejected at {}, well at {}, in at {}; both back at {}; timeline {:?}",
        failed.len(),
        secs(kill),
        retries,
        pool["retries"],
        pool["retry_budget"],
        pool["retries_denied"],
        secs(a_out.0),
        a_out.2,
        secs(a_in),
        secs(sick),
        secs(b_out),
        secs(marks["well"]),
        secs(b_in),
        secs(back),
        timeline
            .0
            .iter()
            .map(|(t, b, s)| format!("{} {b} {s}", secs(*t)))
            .collect::<Vec<_>>(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_wide_503_is_not_multiplied_past_the_budget() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let a = sim(MODEL, &[]).await;
    let b = sim(MODEL, &[]).await;
    // Ejection off, so every failed request has a replica it has not tried: only the budget
    // stands between the outage and twice the traffic.
    let s = serve(&one_pool(
        &[&a.addr, &b.addr],
        json!({"ejection": {"consecutive_failures": 0}}),
    ))
    .await;
    let t0 = Instant::now();
    let warm = open_loop(&s, 40, 20, 8, t0, |_| async {}).await;
    assert!(warm.iter().all(|o| o.complete), "{warm:?}");
    for sim in [&a, &b] {
        let r = client().post(sim.url("/admin/reset")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        // /health stays up: the replicas keep being chosen, as a fleet answering 503 under
        // overload would be.
        sim_admin(sim, "/admin/fail", json!({"mode": "status", "status": 503})).await;
    }
    let n = 60;
    let outage = open_loop(&s, n, 20, 8, t0, |_| async {}).await;
    assert!(outage.iter().all(|o| o.status == 503), "{outage:?}");
    let attempts = sim_stats(&a).await["received"].as_u64().unwrap()
        + sim_stats(&b).await["received"].as_u64().unwrap();
    let pool = pool_status(&s.status().await);
    let retries = sum(&pool["retries"]);
    // 20 % of the 100 requests of the window (more than the minimum of 10): never the 2x of every
    // request tried on both replicas.
    let limit = ((40 + n as u64) / 5).max(10);
    assert_eq!(attempts, n as u64 + retries, "{pool}");
    assert!(
        retries <= limit,
        "{retries} retries past the budget's {limit}: {pool}"
    );
    assert!(
        pool["retries_denied"]["budget"].as_u64() >= Some(n as u64 - limit),
        "{pool}"
    );
    // The client is told why the replica's 503 reached it: its decision says why it was
    // admitted, not why it was not sent elsewhere.
    let told = |why: &str| {
        outage
            .iter()
            .filter(|o| o.retry_denied.as_deref() == Some(why))
            .count() as u64
    };
    assert!(told("budget") >= n as u64 - limit, "{outage:?}");
    assert_eq!(
        told("budget") + told("no_replica") + told("limit"),
        n as u64,
        "{outage:?}"
    );
    println!(
        "fleet-wide 503: {n} requests, {attempts} upstream attempts ({retries} retries, limit {limit}), \
         denied {}",
        pool["retries_denied"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_64_kib_is_resent_whole() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let quick = ["--kv-tokens", "200000", "--prefill-us-per-token", "1"];
    let a = sim(MODEL, &quick).await;
    let b = sim(MODEL, &quick).await;
    let s = serve(&one_pool(
        &[&a.addr, &b.addr],
        json!({"selection": "round_robin", "ejection": {"consecutive_failures": 0}}),
    ))
    .await;
    // A reads each request whole, then resets its connection before answering.
    sim_admin(&a, "/admin/fail", json!({"mode": "reset"})).await;
    let c = client();
    let mut sent = Vec::new();
    for i in 0..12 {
        let prompt = format!("{i} {}", "x".repeat(100_000));
        let body = json!({"model": MODEL, "max_tokens": 4,
                          "messages": [{"role": "user", "content": prompt}]})
        .to_string();
        assert!(body.len() > 64 * 1024);
        let r = c
            .post(s.url("/v1/chat/completions"))
            .header("x-tenant-id", "support-bot")
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let id = header(&r, "x-request-id").to_string();
        let answer: Value = r.json().await.unwrap();
        assert!(answer["choices"][0]["message"].is_object(), "{answer}");
        sent.push((id, body.len()));
        if sim_stats(&a).await["received"].as_u64() >= Some(2) {
            break;
        }
    }
    let (sa, sb) = (sim_stats(&a).await, sim_stats(&b).await);
    assert!(sa["received"].as_u64() >= Some(2), "{sa}");
    assert_eq!(
        sb["received"].as_u64(),
        Some(sent.len() as u64),
        "B answered each"
    );
    let lens: Vec<usize> = sent.iter().map(|(_, l)| *l).collect();
    for st in [&sa, &sb] {
        for r in st["recent"].as_array().unwrap() {
            let got = r["body_bytes"].as_u64().unwrap() as usize;
            assert!(lens.contains(&got), "a body arrived cut: {got} of {lens:?}");
            assert_eq!(r["content_length"], got.to_string());
        }
    }
    let failed_over = sa["received"].as_u64().unwrap();
    let retry_log = retries_logged(&s, failed_over).await;
    for (id, _) in &sent {
        let rec = s.record(id).await;
        assert_eq!(rec["backend"], b.addr.as_str(), "{rec}");
        if let Some(events) = retry_log.get(id) {
            assert_eq!(events.len(), 1, "{events:?}");
            assert_eq!(events[0]["backend"], a.addr.as_str());
            assert_eq!(events[0]["cause"], "reset");
        }
    }
    assert_eq!(retry_log.len() as u64, failed_over, "{retry_log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_is_not_retried_and_a_refused_connect_is() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let a = sim(MODEL, &["--itl-ms", "20"]).await;
    let b = sim(MODEL, &["--itl-ms", "20"]).await;
    let s = serve(&one_pool(&[&a.addr, &b.addr], json!({}))).await;
    // Cut: both replicas close the next stream after three events.
    for sim in [&a, &b] {
        sim_admin(
            sim,
            "/admin/fail",
            json!({"mode": "cut", "after_events": 3, "count": 1}),
        )
        .await;
    }
    let o = send(
        client(),
        s.url("/v1/chat/completions"),
        1000,
        true,
        48,
        Instant::now(),
    )
    .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert!(!o.complete && o.events >= 1 && o.error.is_some(), "{o:?}");
    let received = |st: &Value| st["received"].as_u64().unwrap_or_default();
    let total = received(&sim_stats(&a).await) + received(&sim_stats(&b).await);
    assert_eq!(total, 1, "a started stream is never sent again");
    let rec = s.record("fo-1000").await;
    assert_eq!(rec["error"], "upstream_error", "{rec}");
    assert_eq!(rec["status"], 200, "{rec}");
    assert!(!retries_by_request(&s).contains_key("fo-1000"));
    for sim in [&a, &b] {
        sim_admin(sim, "/admin/fail", json!({"mode": "none"})).await;
    }

    // Refused: A closes its listener for a second; every request is still answered.
    sim_admin(&a, "/admin/fail", json!({"mode": "refuse", "for_ms": 1000})).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let outs = open_loop(&s, 10, 20, 4, Instant::now(), |_| async {}).await;
    assert!(
        outs.iter().all(|o| o.complete),
        "{outs:?} {} {}",
        pool_status(&s.status().await),
        s.log()
            .lines()
            .filter(|l| l.contains("request_failed")
                || l.contains("upstream_retry")
                || l.contains("ejected"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let pool = pool_status(&s.status().await);
    let retries =
        pool["retries"]["connect"].as_u64().unwrap() + pool["retries"]["reset"].as_u64().unwrap();
    let retry_log = retries_logged(&s, retries).await;
    let moved = (0..10)
        .filter_map(|i| retry_log.get(&format!("fo-{i}")))
        .filter(|events| events[0]["backend"] == a.addr.as_str())
        .count() as u64;
    assert!(moved >= 1, "no request met the refusing replica: {pool}");
    assert_eq!(retries, moved, "{pool} {retry_log:?}");
}
