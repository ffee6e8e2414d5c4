//! Fair share between tenants inside one contended tier, over HTTP through real `sluice serve`
//! processes and the project's vLLM simulator: a light tenant that arrives just after a heavy
//! tenant's burst is served alongside it rather than behind it, weights divide the tier's
//! tokens — also between closed-loop clients whose prompts and completions differ in size, at
//! the simulator's pace and at a GPU's (issue 50) — and the same holds across replicas sharing
//! Redis (random key prefix per test).

mod common;
use common::*;
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CAPACITY: u64 = 2;

/// Two tiers' worth of tenants, all Standard: contention is inside one tier.
fn cfg(sim: &str, fair: bool, redis: Option<&RedisNs>) -> Value {
    let mut c = config(&[sim], &[sim]);
    merge(
        &mut c,
        json!({
            "tenants": {
                "heavy": "Standard",
                "light": "Standard",
                "gold": {"tier": "Standard", "weight": 3},
                "bronze": {"tier": "Standard", "weight": 1},
            },
            "tiers": {"Standard": {"inflight_capacity": CAPACITY, "queue": true}},
            "queue": {"max_size": 200, "max_wait_seconds": 60, "fair_share": fair},
        }),
    );
    if let Some(ns) = redis {
        merge(
            &mut c,
            json!({
                "redis_url": ns.url,
                "coordination": {"redis_prefix": ns.prefix, "lease_seconds": 3, "op_timeout_ms": 500},
            }),
        );
    }
    c
}

async fn cluster(sim: &Proc, n: usize, fair: bool, redis: Option<&RedisNs>) -> Vec<Sluice> {
    let mut out = Vec::new();
    for _ in 0..n {
        let s = serve_with(&cfg(&sim.addr, fair, redis), &[], true).await;
        if redis.is_some() {
            wait_for(Duration::from_secs(10), "redis reachable", || async {
                (s.status().await["admission"]["reachable"] == true).then_some(())
            })
            .await;
        }
        out.push(s);
    }
    out
}

/// A prompt long enough that Sluice's estimate (text bytes / 4 and a few tokens of chat
/// template) and the simulator's count (content characters / 4) agree within a few per cent, so
/// token shares can be read from usage.
fn body(max_tokens: u64) -> Value {
    let content = "sluice gates ".repeat(150);
    json!({"model": "llama-3-70b", "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": content}]})
}

/// Sends one request, returning when its whole body arrived and its usage total.
async fn send(s: &Sluice, tenant: &str, max_tokens: u64) -> (Instant, u64) {
    let r = s.chat(tenant, body(max_tokens)).await;
    assert_eq!(r.status(), 200, "{tenant} refused");
    let v: Value = r.json().await.unwrap();
    let tokens = v["usage"]["total_tokens"].as_u64().unwrap_or(0);
    (Instant::now(), tokens)
}

/// One request's whole answer; when it ended.
async fn finish(s: &Sluice, tenant: &'static str) -> (&'static str, Instant) {
    let r = s.chat(tenant, body(30)).await;
    assert_eq!(r.status(), 200, "{tenant} refused");
    let _ = r.bytes().await;
    (tenant, Instant::now())
}

/// Heavy sends 40 at once, light 8 just after (once heavy's are queued): light's mean
/// completion rank over all 48 (1.0 = last).
async fn light_mean_rank(replicas: &[Sluice], redis: Option<&RedisNs>) -> f64 {
    // Heavy's first requests may finish before its last ones arrive (a busy machine sends the
    // burst over some time): the finished ones count as having been let in.
    let finished = AtomicU64::new(0);
    let heavy = join_all((0..40).map(|i| {
        let finished = &finished;
        async move {
            let done = finish(&replicas[i % replicas.len()], "heavy").await;
            finished.fetch_add(1, Ordering::SeqCst);
            done
        }
    }));
    let light = async {
        wait_for(Duration::from_secs(10), "heavy's burst queued", || async {
            let (queued, inflight) = match redis {
                Some(ns) => (ns.zcard("Standard", "queue").unwrap_or(0), CAPACITY),
                None => {
                    let t = tier_status(&replicas[0].status().await, "Standard");
                    let n = |k: &str| t[k].as_u64().unwrap_or(0);
                    (n("queued"), n("inflight"))
                }
            };
            (queued + inflight + finished.load(Ordering::SeqCst) >= 40).then_some(())
        })
        .await;
        join_all((0..8).map(|i| finish(&replicas[i % replicas.len()], "light"))).await
    };
    let (heavy, light) = tokio::join!(heavy, light);
    let mut done: Vec<_> = heavy.into_iter().chain(light).collect();
    done.sort_by_key(|(_, at)| *at);
    let n = done.len() as f64;
    let ranks: Vec<f64> = done
        .iter()
        .enumerate()
        .filter(|(_, (t, _))| *t == "light")
        .map(|(i, _)| (i + 1) as f64 / n)
        .collect();
    ranks.iter().sum::<f64>() / ranks.len() as f64
}

/// Gold (weight 3, 20-token completions) and bronze (weight 1, 100-token ones) keep six
/// requests each outstanding for `secs`: the tokens each was served, from usage.
async fn weighted_tokens(replicas: &[Sluice], secs: u64) -> (u64, u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for (tenant, max_tokens) in [("gold", 20u64), ("bronze", 100)] {
        for w in 0..6 {
            let s = &replicas[w % replicas.len()];
            workers.push(async move {
                let mut served = 0;
                loop {
                    let (at, tokens) = send(s, tenant, max_tokens).await;
                    if at > until {
                        return (tenant, served);
                    }
                    served += tokens;
                }
            });
        }
    }
    let mut gold = 0;
    let mut bronze = 0;
    for (tenant, t) in join_all(workers).await {
        match tenant {
            "gold" => gold += t,
            _ => bronze += t,
        }
    }
    (gold, bronze)
}

/// Over 20 s of both tenants waiting, gold (weight 3) is served 3× bronze's tokens, ± 10 %.
/// Short requests, so the one request each tenant has in flight when the window closes is a
/// few per cent of its count, not a tenth.
async fn assert_three_to_one(replicas: &[Sluice]) {
    let (gold, bronze) = weighted_tokens(replicas, 20).await;
    let share = gold as f64 / bronze as f64;
    eprintln!("gold:bronze tokens {gold}:{bronze} = {share:.3}");
    assert!(
        (2.7..=3.3).contains(&share),
        "gold:bronze tokens {gold}:{bronze} = {share:.2}, want 3 ± 10 %"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_light_tenant_is_served_alongside_a_heavy_burst_not_behind_it() {
    let sim = sim("llama-3-70b", &["--itl-ms", "2"]).await;
    let fair = cluster(&sim, 1, true, None).await;
    let rank = light_mean_rank(&fair, None).await;
    eprintln!("fair share, one replica: light mean completion rank {rank:.3}");
    assert!(
        rank <= 0.45,
        "fair share: light mean completion rank {rank:.2}"
    );
    // The status lists who waits, least served first, while the tier is contended; after the
    // burst nobody waits.
    assert_eq!(
        tier_status(&fair[0].status().await, "Standard")["waiting_tenants"],
        json!([])
    );
    drop(fair);

    // The same burst with fair share off is plain FIFO: light waits behind all of heavy's.
    let fifo = cluster(&sim, 1, false, None).await;
    let rank = light_mean_rank(&fifo, None).await;
    eprintln!("FIFO, one replica: light mean completion rank {rank:.3}");
    assert!(rank >= 0.8, "FIFO: light mean completion rank {rank:.2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_divide_a_contended_tier_by_tokens() {
    let sim = sim("llama-3-70b", &[]).await;
    let replicas = cluster(&sim, 1, true, None).await;
    assert_three_to_one(&replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fair_share_holds_across_three_replicas_on_redis() {
    let sim = sim("llama-3-70b", &["--itl-ms", "2"]).await;
    let ns = RedisNs::new(&shared_redis_url());
    let replicas = cluster(&sim, 3, true, Some(&ns)).await;
    let rank = light_mean_rank(&replicas, Some(&ns)).await;
    eprintln!("fair share, three replicas: light mean completion rank {rank:.3}");
    assert!(rank <= 0.45, "light mean completion rank {rank:.2}");

    assert_three_to_one(&replicas).await;
    // Checked while the replicas run: their last releases may still be on the wire, and only a
    // running replica's scripts sweep a lease that expired.
    wait_for(
        Duration::from_secs(10),
        "no leaked slots or waiters",
        || async { ns.idle().then_some(()) },
    )
    .await;
    drop(replicas);
}

/// One of issue 41's tenants: twelve closed-loop clients sending prompts of `prompt_tokens`
/// for `max_tokens` each.
struct Load {
    tenant: &'static str,
    prompt_tokens: usize,
    max_tokens: u64,
}

const GOLD: Load = Load {
    tenant: "gold",
    prompt_tokens: 200,
    max_tokens: 40,
};
const HEAVY: Load = Load {
    tenant: "heavy",
    prompt_tokens: 800,
    max_tokens: 120,
};
const CLIENTS: usize = 12;

/// Issue 41's setup: Standard capacity 4, a 30 s queue wait so nobody times out behind the
/// favoured tenant, gold at `gold_weight` and heavy at 1.
fn closed_loop_cfg(sim: &str, gold_weight: f64, redis: Option<&RedisNs>) -> Value {
    let mut c = cfg(sim, true, redis);
    merge(
        &mut c,
        json!({
            "tenants": {"gold": {"tier": "Standard", "weight": gold_weight}},
            "tiers": {"Standard": {"inflight_capacity": 4}},
            "queue": {"max_wait_seconds": 30},
        }),
    );
    c
}

/// A chat body whose prompt the simulator counts as exactly `prompt_tokens` (four characters
/// a token).
fn sized_body(load: &Load) -> Value {
    json!({"model": "llama-3-70b", "max_tokens": load.max_tokens,
           "messages": [{"role": "user", "content": "abcd".repeat(load.prompt_tokens)}]})
}

/// Each tenant's clients send their next request `pause` after the last one's answer, for
/// `secs`: the tokens (prompt + completion, from usage) each tenant was served by requests
/// that ended in that time, gold first, and the share of `/status` samples in which both
/// tenants were waiting. Every request must be served as sent: none refused, none capped.
async fn closed_loop_tokens(replicas: &[Sluice], secs: u64, pause: Duration) -> ([u64; 2], f64) {
    let until = Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for (i, load) in [&GOLD, &HEAVY].into_iter().enumerate() {
        for c in 0..CLIENTS {
            let s = &replicas[c % replicas.len()];
            workers.push(async move {
                let http = client();
                let mut served = 0;
                loop {
                    let r = http
                        .post(s.url("/v1/chat/completions"))
                        .header("x-tenant-id", load.tenant)
                        .json(&sized_body(load))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200, "{} refused", load.tenant);
                    let v: Value = r.json().await.unwrap();
                    if Instant::now() > until {
                        return (i, served);
                    }
                    let usage = &v["usage"];
                    assert_eq!(usage["completion_tokens"], load.max_tokens, "capped: {v}");
                    served += usage["total_tokens"].as_u64().unwrap_or(0);
                    tokio::time::sleep(pause).await;
                }
            });
        }
    }
    let sampler = async {
        let (mut both, mut samples) = (0, 0);
        while Instant::now() < until {
            let t = replicas[0].tier("Standard").await;
            samples += 1;
            both += usize::from(
                t["waiting_tenants"]
                    .as_array()
                    .is_some_and(|w| w.len() == 2),
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        both as f64 / samples.max(1) as f64
    };
    let (served, both) = tokio::join!(join_all(workers), sampler);
    let mut tokens = [0; 2];
    for (i, t) in served {
        tokens[i] += t;
    }
    (tokens, both)
}

/// Issue 41: with weights `gold_weight`:1, gold's share of the tokens is within 15 % of its
/// weight over heavy's, both tenants waiting throughout. Clients pause `pause` between an answer
/// and their next request, so the favoured tenant's queue empties now and then.
async fn assert_closed_loop_share(sim: &Proc, replicas: usize, gold_weight: f64, pause: Duration) {
    let ns = RedisNs::new(&shared_redis_url());
    let redis = (replicas > 1).then_some(&ns);
    let mut cluster = Vec::new();
    for _ in 0..replicas {
        let s = serve_with(&closed_loop_cfg(&sim.addr, gold_weight, redis), &[], true).await;
        if redis.is_some() {
            wait_for(Duration::from_secs(10), "redis reachable", || async {
                (s.status().await["admission"]["reachable"] == true).then_some(())
            })
            .await;
        }
        cluster.push(s);
    }
    let ([gold, heavy], both) = closed_loop_tokens(&cluster, 15, pause).await;
    let share = gold as f64 / heavy as f64;
    eprintln!(
        "{replicas} replica(s), weights {gold_weight}:1: gold:heavy tokens {gold}:{heavy} = \
         {share:.3}, both waiting in {:.0} % of samples",
        both * 100.0
    );
    assert!(
        both >= 0.8,
        "both tenants waiting in only {:.0} % of samples",
        both * 100.0
    );
    assert!(
        (share / gold_weight - 1.0).abs() <= 0.15,
        "weights {gold_weight}:1: gold:heavy tokens {gold}:{heavy} = {share:.2}, want within 15 %"
    );
}

/// A client's own turnaround between an answer and its next request: enough for gold's queue
/// to empty at times, well short of leaving gold without the demand for its share (near 250 ms
/// on a two-core machine running the other tests too).
const PAUSE: Duration = Duration::from_millis(100);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weighted_token_shares_hold_for_unequal_sizes_and_closed_loop_clients() {
    let sim = sim("llama-3-70b", &[]).await;
    for weight in [1.0, 3.0] {
        assert_closed_loop_share(&sim, 1, weight, PAUSE).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weighted_token_shares_hold_across_three_replicas_on_redis() {
    let sim = sim("llama-3-70b", &[]).await;
    for weight in [1.0, 3.0] {
        assert_closed_loop_share(&sim, 3, weight, PAUSE).await;
    }
}

/// A GPU's pace (issue 50): 15 ms a decode step and 20,000 prompt tokens a second of prefill, so
/// gold's requests hold a slot ~0.7 s and heavy's ~2 s (more as the batch's KV grows), against
/// ~0.1 s at the simulator's default 1 ms a token.
const GPU: [&str; 4] = ["--itl-ms", "15", "--prefill-us-per-token", "50"];

/// How long each GPU-paced run lasts: heavy is served ~11 requests in it at 3:1.
const GPU_SECS: u64 = 25;

/// Issue 50's setup on `replicas` replicas (sharing Redis beyond one): issue 41's, with the
/// queue wait raised so that none of heavy's twelve clients (each waiting ~25 s for its turn
/// at 3:1) times out.
async fn gpu_cluster(sim: &Proc, replicas: usize, gold_weight: f64, ns: &RedisNs) -> Vec<Sluice> {
    let redis = (replicas > 1).then_some(ns);
    let mut cfg = closed_loop_cfg(&sim.addr, gold_weight, redis);
    merge(&mut cfg, json!({"queue": {"max_wait_seconds": 60}}));
    let mut cluster = Vec::new();
    for _ in 0..replicas {
        let s = serve_with(&cfg, &[], true).await;
        if redis.is_some() {
            wait_for(Duration::from_secs(10), "redis reachable", || async {
                (s.status().await["admission"]["reachable"] == true).then_some(())
            })
            .await;
        }
        cluster.push(s);
    }
    cluster
}

/// Sends `load`'s next request streamed and reads it to the end: when it was admitted (sent
/// plus its queue wait) and ended, and its usage total. `None` when it was still waiting at
/// `until` (given up: the client leaves the queue).
async fn streamed(
    http: &reqwest::Client,
    s: &Sluice,
    load: &Load,
    until: Instant,
) -> Option<(Instant, Instant, u64)> {
    let mut body = sized_body(load);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let sent = Instant::now();
    let req = http
        .post(s.url("/v1/chat/completions"))
        .header("x-tenant-id", load.tenant)
        .json(&body)
        .send();
    // The answer's header comes with its first token: until then the request waits.
    let mut r = tokio::time::timeout_at(until.into(), req)
        .await
        .ok()?
        .unwrap();
    assert_eq!(r.status(), 200, "{} refused", load.tenant);
    let waited: f64 = header(&r, "x-sluice-queue-wait-ms").parse().unwrap_or(0.0);
    let admitted = sent + Duration::from_secs_f64(waited / 1000.0);
    let mut text = Vec::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.extend_from_slice(&chunk);
    }
    let ended = Instant::now();
    let text = String::from_utf8(text).unwrap();
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .map(|v| v["usage"].clone())
        .rfind(|u| u.is_object())
        .unwrap_or_else(|| panic!("no usage in {text}"));
    assert_eq!(
        usage["completion_tokens"], load.max_tokens,
        "capped: {usage}"
    );
    Some((admitted, ended, usage["total_tokens"].as_u64().unwrap_or(0)))
}

/// How a GPU-paced run is loaded: closed-loop clients per tenant (gold first), the pause between
/// an answer and the client's next request, and how long after heavy's clients gold's start
/// (heavy then holds every slot when gold comes: the case the lift has to get right).
struct Run {
    clients: [usize; 2],
    pause: Duration,
    gold_after: Duration,
}

/// Heavy's twelve clients take every slot, and gold's twelve come 300 ms later.
const HEAVY_FIRST: Run = Run {
    clients: [CLIENTS, CLIENTS],
    pause: Duration::ZERO,
    gold_after: Duration::from_millis(300),
};

/// Gold has four clients that pause 100 ms after each answer, so its queue is empty whenever
/// one of its requests ends: the case the kept slot has to get right.
const FEW_GOLD_CLIENTS: Run = Run {
    clients: [4, CLIENTS],
    pause: Duration::from_millis(100),
    gold_after: Duration::ZERO,
};

/// Runs `run` for `GPU_SECS`: the tokens each tenant was served over that time (gold first), a
/// request counting for the part of its time holding a slot that fell in it (so the few long
/// requests heavy has running at the end count for what they had, not all or nothing); and the
/// share of `/status` samples in which both tenants were waiting.
async fn gpu_closed_loop(replicas: &[Sluice], run: &Run) -> ([f64; 2], f64) {
    let start = Instant::now();
    let until = start + Duration::from_secs(GPU_SECS);
    let mut workers = Vec::new();
    for (i, load) in [&GOLD, &HEAVY].into_iter().enumerate() {
        let after = if i == 0 {
            run.gold_after
        } else {
            Duration::ZERO
        };
        for c in 0..run.clients[i] {
            let s = &replicas[c % replicas.len()];
            let pause = run.pause;
            workers.push(async move {
                let http = reqwest::Client::new();
                let mut served = 0.0;
                tokio::time::sleep(after).await;
                while Instant::now() < until {
                    let Some((admitted, ended, tokens)) = streamed(&http, s, load, until).await
                    else {
                        break;
                    };
                    let held = ended.duration_since(admitted).as_secs_f64();
                    let within = until
                        .min(ended)
                        .saturating_duration_since(admitted.max(start));
                    served += tokens as f64 * (within.as_secs_f64() / held).min(1.0);
                    tokio::time::sleep(pause).await;
                }
                (i, served)
            });
        }
    }
    let sampler = async {
        tokio::time::sleep(run.gold_after + Duration::from_millis(500)).await;
        let (mut both, mut samples) = (0, 0);
        while Instant::now() < until {
            let t = replicas[0].tier("Standard").await;
            samples += 1;
            both += usize::from(
                t["waiting_tenants"]
                    .as_array()
                    .is_some_and(|w| w.len() == 2),
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        both as f64 / samples.max(1) as f64
    };
    let (served, both) = tokio::join!(join_all(workers), sampler);
    let mut tokens = [0.0; 2];
    for (i, t) in served {
        tokens[i] += t;
    }
    (tokens, both)
}

/// Issue 50: at a GPU's pace, with weights `gold_weight`:1, gold's share of the tokens is within
/// 15 % of its weight over heavy's, over the run from its start, heavy waiting throughout (and
/// gold too, unless its few clients pause). Sluice charges a prompt by its text, not its body's
/// bytes: counting the JSON put gold's 240-token requests at ~270 and heavy's 920 at ~950, and
/// the share ~8 % under the weight (0.84 at 1:1 with gold's few clients, on a busy host).
async fn assert_gpu_share(replicas: usize, gold_weight: f64, run: &Run) {
    let sim = sim("llama-3-70b", &GPU).await;
    let ns = RedisNs::new(&shared_redis_url());
    let cluster = gpu_cluster(&sim, replicas, gold_weight, &ns).await;
    let ([gold, heavy], both) = gpu_closed_loop(&cluster, run).await;
    let share = gold / heavy;
    eprintln!(
        "GPU pace, {replicas} replica(s), {:?} clients, pause {:?}, gold after {:?}, weights \
         {gold_weight}:1: gold:heavy tokens {gold:.0}:{heavy:.0} = {share:.3}, both waiting \
         in {:.0} % of samples",
        run.clients,
        run.pause,
        run.gold_after,
        both * 100.0
    );
    if run.clients[0] >= CLIENTS {
        assert!(
            both >= 0.8,
            "both tenants waiting in only {:.0} % of samples",
            both * 100.0
        );
    }
    assert!(
        (share / gold_weight - 1.0).abs() <= 0.15,
        "weights {gold_weight}:1: gold:heavy tokens {gold:.0}:{heavy:.0} = {share:.2}, want \
         within 15 %"
    );
}

/// Before issue 50 gold, coming when heavy held every slot, was lifted over the charges of all
/// but one of heavy's running requests: 1.99 here (0.78 at 1:1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_three_to_one_hold_at_gpu_timings() {
    assert_gpu_share(1, 3.0, &HEAVY_FIRST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_one_to_one_hold_at_gpu_timings() {
    assert_gpu_share(1, 1.0, &HEAVY_FIRST).await;
}

/// Before issue 50 every slot gold freed went to heavy for its ~2 s while gold's client paused:
/// 0.75 here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_with_few_clients_keeps_its_share_at_gpu_timings() {
    assert_gpu_share(1, 1.0, &FEW_GOLD_CLIENTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_three_to_one_hold_at_gpu_timings_across_three_replicas_on_redis() {
    assert_gpu_share(3, 3.0, &HEAVY_FIRST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_one_to_one_hold_at_gpu_timings_across_three_replicas_on_redis() {
    assert_gpu_share(3, 1.0, &HEAVY_FIRST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_with_few_clients_keeps_its_share_at_gpu_timings_across_three_replicas() {
    assert_gpu_share(3, 1.0, &FEW_GOLD_CLIENTS).await;
}
