//! Shared admission across real `sluice serve` processes on one Redis: the bound under a burst,
//! FIFO across replicas, a replica killed while holding streams, a Redis outage mid-load, the
//! accounting after a long mixed run, and requests in flight told apart from capacity credits. The shared Redis is `SLUICE_TEST_REDIS_URL` (default
//! 127.0.0.1:6379) under a random prefix per test; the outage test runs its own redis-server.

mod common;
use common::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STANDARD: &str = "coding-assistant";
const GUARANTEED: &str = "support-bot";
const BEST_EFFORT: &str = "batch-analytics";

fn shared_url() -> String {
    shared_redis_url()
}

type Ns = RedisNs;

/// A replica's config: one simulator for both pools, the given Redis and prefix.
fn replica_cfg(sim: &str, ns: &Ns, patch: Value) -> Value {
    let mut c = config(&[sim], &[sim]);
    merge(
        &mut c,
        json!({
            "redis_url": ns.url,
            // The longest op timeout a 1.5 s lease allows: a loaded test machine must not
            // turn a slow call into a fail-open.
            "coordination": {"redis_prefix": ns.prefix, "lease_seconds": 1.5, "op_timeout_ms": 500},
            "tiers": {"Standard": {"inflight_capacity": 4}},
        }),
    );
    merge(&mut c, patch);
    c
}

async fn replicas(n: usize, cfg: impl Fn() -> Value) -> Vec<Sluice> {
    let mut out = Vec::new();
    for _ in 0..n {
        let s = serve_with(&cfg(), &[], true).await;
        wait_reachable(&s).await;
        out.push(s);
    }
    out
}

async fn wait_reachable(s: &Sluice) {
    wait_for(
        Duration::from_secs(10),
        "redis coordinator reachable",
        || async {
            let st = s.status().await;
            (st["coordinator"] == "redis" && st["admission"]["reachable"] == true).then_some(())
        },
    )
    .await
}

/// Every replica reports nothing in flight or queued and no held or fail-open slots, and Redis
/// agrees; returns how long that took.
async fn wait_idle(rs: &[&Sluice], ns: &Ns, within: Duration) -> Duration {
    let start = Instant::now();
    wait_for(within, "counters and leases back to zero", || async {
        for s in rs {
            let st = s.status().await;
            let busy = st["tiers"]
                .as_array()?
                .iter()
                .any(|t| t["inflight"] != 0 || t["queued"] != 0);
            let a = &st["admission"];
            if busy || a["held_slots"] != 0 || a["fail_open_inflight"] != 0 {
                return None;
            }
        }
        ns.idle().then_some(())
    })
    .await;
    start.elapsed()
}

fn body(max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "llama-3-70b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

async fn post(
    c: &reqwest::Client,
    s: &Sluice,
    tenant: &str,
    b: &Value,
) -> reqwest::Result<reqwest::Response> {
    c.post(s.url("/v1/chat/completions"))
        .header("x-tenant-id", tenant)
        .json(b)
        .send()
        .await
}

async fn reset(sim: &Proc) {
    let r = client().post(sim.url("/admin/reset")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

fn reason(r: &reqwest::Response) -> String {
    header(r, "x-sluice-reason").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_never_exceed_the_shared_capacity_under_a_burst() {
    let ns = Ns::new(&shared_url());
    let sim = sim("llama-3-70b", &["--ttft-ms", "200"]).await;
    let rs = replicas(3, || {
        replica_cfg(
            &sim.addr,
            &ns,
            json!({"queue": {"max_size": 300, "max_wait_seconds": 3}}),
        )
    })
    .await;
    reset(&sim).await;

    let c = client();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let c = c.clone();
        let url = rs[i % 3].url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .header("x-tenant-id", STANDARD)
                .json(&body(4, false))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), reason(&r))
        }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        let (status, why) = t.await.unwrap();
        match status {
            200 => ok += 1,
            429 => {
                assert!(
                    why == "queue_timed_out" || why == "queue_dropped",
                    "refused for {why}"
                );
                refused += 1;
            }
            other => panic!("unexpected {other} ({why})"),
        }
        assert_ne!(why, "coordinator_unavailable_fail_open");
    }
    let stats = sim_stats(&sim).await;
    let peak = stats["peak_running"].as_u64().unwrap();
    let peak_in_flight = stats["peak_in_flight"].as_u64().unwrap();
    println!(
        "3 replicas, Standard capacity 4, 200 concurrent: peak_running {peak}, \
         peak_in_flight {peak_in_flight}, served {ok}, refused {refused} in {:?}",
        started.elapsed()
    );
    assert!(
        peak_in_flight <= 4,
        "shared bound exceeded: {peak_in_flight}"
    );
    assert_eq!(peak, 4, "the bound is reached, not just respected");
    assert_eq!(ok + refused, 200);
    assert!(ok >= 20, "served {ok}");
    let refs: Vec<&Sluice> = rs.iter().collect();
    wait_idle(&refs, &ns, Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_queued_through_different_replicas_are_released_in_arrival_order() {
    let ns = Ns::new(&shared_url());
    let sim = sim("llama-3-70b", &["--ttft-ms", "150"]).await;
    let rs = replicas(3, || {
        replica_cfg(
            &sim.addr,
            &ns,
            json!({"tiers": {"Standard": {"inflight_capacity": 1}},
                   "queue": {"max_size": 20, "max_wait_seconds": 10}}),
        )
    })
    .await;
    reset(&sim).await;
    let c = client();
    // The holder is slow so every waiter is queued before the first release.
    client()
        .put(sim.url("/admin/latency"))
        .json(&json!({"extra_ms": 600}))
        .send()
        .await
        .unwrap();
    let holder = {
        let (c, s) = (c.clone(), rs[0].url("/v1/chat/completions"));
        tokio::spawn(async move {
            c.post(s)
                .header("x-tenant-id", STANDARD)
                .json(&body(1, false))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    wait_for(
        Duration::from_secs(5),
        "the holder at the simulator",
        || async { (sim_stats(&sim).await["running"] == 1).then_some(()) },
    )
    .await;
    client()
        .put(sim.url("/admin/latency"))
        .json(&json!({"extra_ms": 0}))
        .send()
        .await
        .unwrap();
    let mut waiters = Vec::new();
    for i in 0..6u64 {
        let (c, s) = (
            c.clone(),
            rs[(i as usize + 1) % 3].url("/v1/chat/completions"),
        );
        waiters.push(tokio::spawn(async move {
            let r = c
                .post(s)
                .header("x-tenant-id", STANDARD)
                .json(&body(10 + i, false))
                .send()
                .await
                .unwrap();
            (r.status(), reason(&r))
        }));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(holder.await.unwrap(), 200);
    for w in waiters {
        let (status, why) = w.await.unwrap();
        assert_eq!((status.as_u16(), why.as_str()), (200, "queue_released"));
    }
    let recent = sim_stats(&sim).await["recent"].as_array().unwrap().clone();
    let order: Vec<u64> = recent
        .iter()
        .filter_map(|r| r["max_tokens"].as_u64())
        .collect();
    // The order the waiters reached Sluice, from their records: sent 60 ms apart, but a busy
    // machine can delay one client's send past the next one's, and FIFO is by arrival.
    // Records are made after the response is written: wait for all six.
    let arrived = wait_for(Duration::from_secs(3), "the waiters' records", || async {
        let mut arrived: Vec<(u64, u64)> = Vec::new();
        for r in &rs {
            for d in r.recent("limit=50").await {
                if let (Some(t), Some(at)) = (
                    d["requested_max_tokens"].as_u64(),
                    d["received_at_ms"].as_u64(),
                ) {
                    if (10..16).contains(&t) {
                        arrived.push((at, t));
                    }
                }
            }
        }
        arrived.sort();
        (arrived.len() == 6).then_some(arrived)
    })
    .await;
    let mut expected = vec![1];
    expected.extend(arrived.iter().map(|&(_, t)| t));
    println!("order at the simulator: {order:?}; arrival at Sluice: {arrived:?}");
    assert_eq!(order, expected);
    let refs: Vec<&Sluice> = rs.iter().collect();
    wait_idle(&refs, &ns, Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_replicas_slots_return_within_the_lease() {
    let ns = Ns::new(&shared_url());
    let lease = Duration::from_millis(1500);
    let sim = sim("llama-3-70b", &["--itl-ms", "20"]).await;
    let cfg = || {
        replica_cfg(
            &sim.addr,
            &ns,
            json!({"tiers": {"Standard": {"inflight_capacity": 3, "queue": false}}}),
        )
    };
    let mut rs = replicas(2, cfg).await;
    let c = client();
    // Three long SSE streams hold every Standard slot on replica 0.
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut r = post(&c, &rs[0], STANDARD, &body(2000, true)).await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some(), "streaming");
        streams.push(r);
    }
    let r = post(&c, &rs[1], STANDARD, &body(4, false)).await.unwrap();
    assert_eq!(
        (r.status().as_u16(), reason(&r).as_str()),
        (429, "tier_at_capacity")
    );

    let mut killed = rs.remove(0);
    killed.proc.child.kill().unwrap(); // SIGKILL: no release, no shutdown hook
    let _ = killed.proc.child.wait();
    let t0 = Instant::now();
    drop(streams);
    let survivor = &rs[0];
    let back_after = loop {
        let r = post(&c, survivor, STANDARD, &body(4, false)).await.unwrap();
        if r.status() == 200 {
            break t0.elapsed();
        }
        assert_eq!(reason(&r), "tier_at_capacity");
        assert!(t0.elapsed() < lease * 3, "slots never came back");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    println!("killed replica's 3 slots returned {back_after:?} after SIGKILL (lease {lease:?})");
    assert!(back_after <= lease + Duration::from_millis(300));

    // All three are usable again, concurrently (once the probe's own slot is released).
    wait_idle(&[survivor], &ns, Duration::from_secs(3)).await;
    let small = body(4, false);
    let all =
        futures_util::future::join_all((0..3).map(|_| post(&c, survivor, STANDARD, &small))).await;
    for r in all {
        assert_eq!(r.unwrap().status(), 200);
    }
    let h = survivor.status().await["admission"].clone();
    assert!(h["reclaimed_leases_total"].as_u64().unwrap() >= 3, "{h}");
    assert_eq!(h["fail_open_total"], 0);
    wait_idle(&[survivor], &ns, Duration::from_secs(3)).await;
}

/// (phase, status, reason) of every response of a background load.
type Log = Arc<Mutex<Vec<(u8, u16, String)>>>;

/// Keeps `workers` requests in flight, spread over the replicas, until `stop` is set.
fn load(
    urls: Vec<String>,
    workers: usize,
    b: Value,
    phase: Arc<std::sync::atomic::AtomicU8>,
    stop: Arc<AtomicBool>,
    log: Log,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|w| {
            let (urls, b, phase, stop, log) = (
                urls.clone(),
                b.clone(),
                phase.clone(),
                stop.clone(),
                log.clone(),
            );
            tokio::spawn(async move {
                let c = client();
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let p = phase.load(Ordering::Relaxed);
                    let r = c
                        .post(&urls[i % urls.len()])
                        .header("x-tenant-id", STANDARD)
                        .json(&b)
                        .send()
                        .await;
                    let entry = match r {
                        Ok(r) => {
                            let e = (p, r.status().as_u16(), reason(&r));
                            let _ = r.bytes().await;
                            e
                        }
                        Err(e) => (p, 0, e.to_string()),
                    };
                    log.lock().unwrap().push(entry);
                    i += 1;
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_stopped_mid_load_fails_open_then_enforces_again_without_leaks() {
    let mut redis = PrivateRedis::start(free_port()).await;
    let ns = Ns::new(&format!("redis://127.0.0.1:{}", redis.port));
    let sim = sim("llama-3-70b", &["--ttft-ms", "60"]).await;
    let rs = replicas(2, || {
        replica_cfg(
            &sim.addr,
            &ns,
            json!({"tiers": {"Standard": {"inflight_capacity": 2}},
                   "queue": {"max_size": 50, "max_wait_seconds": 2}}),
        )
    })
    .await;
    let urls: Vec<String> = rs.iter().map(|s| s.url("/v1/chat/completions")).collect();
    let phase = Arc::new(std::sync::atomic::AtomicU8::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let log: Log = Arc::default();
    let workers = load(
        urls.clone(),
        6,
        body(4, false),
        phase.clone(),
        stop.clone(),
        log.clone(),
    );

    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.stop();
    phase.store(2, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = rs[0].status().await["admission"].clone();
    assert_eq!(during["reachable"], false, "{during}");
    assert!(during["fail_open_total"].as_u64().unwrap() > 0);
    assert!(during["last_error"].is_string());
    let metrics = rs[0].metrics().await;
    let fail_open_metric = metrics
        .lines()
        .find(|l| l.starts_with("sluice_coordinator_events_total{event=\"fail_open\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        fail_open_metric > 0,
        "fail-open admissions are counted on /metrics"
    );

    let _redis = PrivateRedis::start(redis.port).await;
    phase.store(3, Ordering::Relaxed);
    let t0 = Instant::now();
    for s in &rs {
        wait_reachable(s).await;
    }
    println!(
        "both replicas back on Redis {:?} after restart",
        t0.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    phase.store(4, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    let log = log.lock().unwrap().clone();
    let count = |f: &dyn Fn(&(u8, u16, String)) -> bool| log.iter().filter(|e| f(e)).count();
    let fail_open =
        count(&|e| e.0 == 2 && e.1 == 200 && e.2 == "coordinator_unavailable_fail_open");
    println!(
        "requests: {} total, {fail_open} admitted fail-open while Redis was down",
        log.len()
    );
    assert!(fail_open > 10, "requests kept flowing, visibly");
    for e in &log {
        assert!(e.1 == 200 || e.1 == 429, "unexpected response {e:?}");
    }
    assert_eq!(
        count(&|e| e.0 == 4 && e.2 == "coordinator_unavailable_fail_open"),
        0,
        "back on Redis"
    );

    // The bound holds again.
    reset(&sim).await;
    let c = client();
    let small = body(4, false);
    let burst =
        futures_util::future::join_all((0..30).map(|i| post(&c, &rs[i % 2], STANDARD, &small)))
            .await;
    for r in burst {
        let r = r.unwrap();
        assert_ne!(reason(&r), "coordinator_unavailable_fail_open");
    }
    let peak = sim_stats(&sim).await["peak_in_flight"].as_u64().unwrap();
    println!("after the restart: peak in flight {peak} (capacity 2)");
    assert!(peak <= 2);
    let refs: Vec<&Sluice> = rs.iter().collect();
    wait_idle(&refs, &ns, Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_long_mixed_run_every_counter_and_lease_returns_to_zero() {
    let ns = Ns::new(&shared_url());
    let mut od = sim("llama-3-70b", &["--ttft-ms", "40", "--itl-ms", "3"]).await;
    let spot = sim("llama-3-70b", &["--ttft-ms", "40"]).await;
    let cfg = || {
        let mut c = config(&[&od.addr], &[&spot.addr]);
        merge(
            &mut c,
            json!({
                "redis_url": ns.url,
                // The default 5 s lease: counters must return to zero through explicit
                // releases, well before any lease could expire.
                "coordination": {"redis_prefix": ns.prefix, "op_timeout_ms": 1000},
                "tiers": {
                    "Guaranteed": {"inflight_capacity": 2},
                    "Standard": {"inflight_capacity": 3},
                    "Best-Effort": {"inflight_capacity": 2},
                },
                "queue": {"max_size": 6, "max_wait_seconds": 0.15},
            }),
        );
        c
    };
    let rs = Arc::new(replicas(2, cfg).await);
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..12usize {
        let (rs, stop, seen) = (rs.clone(), stop.clone(), seen.clone());
        workers.push(tokio::spawn(async move {
            let c = client();
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                let s = &rs[i % 2];
                let outcome = match i % 8 {
                    // Streams read to the end.
                    0 => match post(&c, s, STANDARD, &body(30, true)).await {
                        Ok(r) => {
                            let st = r.status().as_u16();
                            let why = reason(&r);
                            let _ = r.bytes().await;
                            format!("{st} {why} stream")
                        }
                        Err(_) => "send error".into(),
                    },
                    // The client goes away mid-stream.
                    1 | 6 => match post(
                        &c,
                        s,
                        if i % 8 == 1 { GUARANTEED } else { STANDARD },
                        &body(400, true),
                    )
                    .await
                    {
                        Ok(mut r) => {
                            let st = r.status().as_u16();
                            let why = reason(&r);
                            let _ = r.chunk().await;
                            drop(r);
                            format!("{st} {why} dropped mid-stream")
                        }
                        Err(_) => "send error".into(),
                    },
                    2 => match post(&c, s, GUARANTEED, &body(8, false)).await {
                        Ok(r) => format!("{} {}", r.status().as_u16(), reason(&r)),
                        Err(_) => "send error".into(),
                    },
                    3 => match post(&c, s, BEST_EFFORT, &body(8, false)).await {
                        Ok(r) => format!("{} {}", r.status().as_u16(), reason(&r)),
                        Err(_) => "send error".into(),
                    },
                    // Gives up while queued (or in flight).
                    4 => {
                        let r = c
                            .post(s.url("/v1/chat/completions"))
                            .header("x-tenant-id", STANDARD)
                            .timeout(Duration::from_millis(150))
                            .json(&body(20, false))
                            .send()
                            .await;
                        match r {
                            Ok(r) => format!("{} {}", r.status().as_u16(), reason(&r)),
                            Err(_) => "client timeout".into(),
                        }
                    }
                    _ => match post(&c, s, STANDARD, &body(8, false)).await {
                        Ok(r) => {
                            let out = format!("{} {}", r.status().as_u16(), reason(&r));
                            let _ = r.bytes().await;
                            out
                        }
                        Err(_) => "send error".into(),
                    },
                };
                // Refusals come back at once; pacing them keeps the mix from being all 429s.
                if outcome.starts_with("429") {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                seen.lock().unwrap().push(outcome);
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    // Upstream errors: the on-demand backend disappears mid-load.
    od.child.kill().unwrap();
    let _ = od.child.wait();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    let seen = seen.lock().unwrap().clone();
    let has = |s: &str| seen.iter().filter(|o| o.contains(s)).count();
    println!(
        "{} requests: {} ok, {} dropped mid-stream, {} queue timeouts, {} queue drops, \
         {} at capacity, {} client timeouts, {} upstream errors (5xx)",
        seen.len(),
        has("200 "),
        seen.iter()
            .filter(|o| o.starts_with("200") && o.ends_with("dropped mid-stream"))
            .count(),
        has("queue_timed_out"),
        has("queue_dropped"),
        has("tier_at_capacity"),
        has("client timeout"),
        seen.iter().filter(|o| o.starts_with('5')).count(),
    );
    assert!(has("200 ") > 0);
    assert!(seen
        .iter()
        .any(|o| o.starts_with("200") && o.ends_with("dropped mid-stream")));
    assert!(has("queue_timed_out") > 0 && has("queue_dropped") > 0);
    assert!(seen.iter().any(|o| o.starts_with('5')), "upstream errors");
    assert_eq!(has("coordinator_unavailable_fail_open"), 0);

    let rr: Vec<&Sluice> = rs.iter().collect();
    let took = wait_idle(&rr, &ns, Duration::from_millis(2500)).await;
    println!("idle {took:?} after the load stopped (lease 5 s)");
    for s in rr {
        let a = s.status().await["admission"].clone();
        assert_eq!(a["fail_open_total"], 0, "{a}");
        assert_eq!(a["lost_leases_total"], 0, "{a}");
    }
}

/// Every replica's `/status` for `tier`: requests in flight, idle credits (both cluster-wide),
/// and the idle credits the replica itself reports holding (every tier).
async fn credit_figures(rs: &[Sluice], tier: &str) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    for s in rs {
        let st = s.status().await;
        let t = tier_status(&st, tier);
        let n = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
        out.push((
            n(&t["inflight"]),
            n(&t["idle_credits"]),
            n(&st["admission"]["idle_credits"]),
        ));
    }
    out
}

/// Issue 41: a tier with capacity credits keeps leased slots on each replica after the load
/// ends. They count against the capacity but are no requests: every replica's `/status` and
/// `/metrics` show the requests in flight (0 once nothing runs) and the idle credits apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_in_flight_and_idle_credits_are_shown_apart() {
    let ns = Ns::new(&shared_url());
    let sim = sim("llama-3-70b", &[]).await;
    // Capacity 256: blocks of 16 credits.
    let rs = replicas(2, || {
        replica_cfg(
            &sim.addr,
            &ns,
            json!({"tiers": {"Guaranteed": {"inflight_capacity": 256}}}),
        )
    })
    .await;
    let c = client();
    let small = body(4, false);
    // Load through both replicas until each holds a block of credits.
    wait_for(
        Duration::from_secs(20),
        "credits on both replicas",
        || async {
            let sent = futures_util::future::join_all(
                (0..20).map(|i| post(&c, &rs[i % 2], GUARANTEED, &small)),
            )
            .await;
            assert!(sent
                .iter()
                .all(|r| r.as_ref().is_ok_and(|r| r.status() == 200)));
            let figures = credit_figures(&rs, "Guaranteed").await;
            figures.iter().all(|f| f.2 > 0).then_some(())
        },
    )
    .await;

    // Requests running now are counted as requests, whether a credit or a script admitted them.
    let long = body(3000, false);
    let running =
        futures_util::future::join_all((0..6).map(|i| post(&c, &rs[i % 2], GUARANTEED, &long)));
    let watch = wait_for(
        Duration::from_secs(10),
        "six requests in flight",
        || async {
            let f = credit_figures(&rs, "Guaranteed").await;
            f.iter().all(|f| f.0 == 6).then_some(f)
        },
    );
    let (done, during) = tokio::join!(running, watch);
    assert!(done
        .iter()
        .all(|r| r.as_ref().is_ok_and(|r| r.status() == 200)));
    eprintln!("while six ran: (in flight, idle credits, own idle credits) per replica {during:?}");

    // After the load: nothing in flight, the credits still held and shown as credits, and the
    // same on every replica (each one's idle credits add up to the cluster's).
    let after = wait_for(Duration::from_secs(10), "nothing in flight", || async {
        let f = credit_figures(&rs, "Guaranteed").await;
        let own: u64 = f.iter().map(|f| f.2).sum();
        f.iter().all(|f| f.0 == 0 && f.1 == own).then_some(f)
    })
    .await;
    eprintln!("after the load: {after:?}");
    let idle = after[0].1;
    assert!(idle >= 32, "two blocks of 16 at least: {after:?}");
    assert_eq!(
        ns.zcard("Guaranteed", "slots"),
        Some(idle),
        "Redis holds exactly the idle credits as leases"
    );
    for s in &rs {
        let m = s.metrics().await;
        for line in [
            r#"sluice_inflight_requests{tier="Guaranteed"} 0"#.to_string(),
            format!(r#"sluice_idle_credits{{tier="Guaranteed"}} {idle}"#),
        ] {
            assert!(m.contains(&line), "/metrics lacks `{line}`");
        }
    }
}
