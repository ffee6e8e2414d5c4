//! Per-tenant quotas against real `sluice serve` processes and the vLLM simulator: a budget
//! crossed mid-run demotes (not refuses) across two replicas sharing Redis and refills on time,
//! a long completion's usage leaves a token debt, Best-Effort over budget is refused with
//! `retry-after`, a reload applies a changed budget, and a Redis outage fails open. The shared
//! Redis is `SLUICE_TEST_REDIS_URL` (default 127.0.0.1:6379) under a random prefix per test; the
//! outage test runs its own redis-server.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const GUARANTEED: &str = "support-bot";
const STANDARD: &str = "coding-assistant";
const BEST_EFFORT: &str = "batch-analytics";

/// A fast simulator: a few ms per answer, so a budget of 60 is spent in about a second.
async fn fast_sim() -> Proc {
    sim("llama-3-70b", &["--ttft-ms", "1", "--itl-ms", "0.05"]).await
}

/// One simulator for both pools; `tenants` replaces the given tenants' entries.
fn cfg(sim: &Proc, tenants: Value, redis: Option<&RedisNs>) -> Value {
    let mut c = config(&[&sim.addr], &[&sim.addr]);
    merge(&mut c, json!({ "tenants": tenants }));
    if let Some(ns) = redis {
        merge(
            &mut c,
            json!({"redis_url": ns.url,
                   "coordination": {"redis_prefix": ns.prefix, "op_timeout_ms": 500}}),
        );
    }
    c
}

fn body(max_tokens: u64) -> Value {
    json!({"model": "llama-3-70b", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": max_tokens})
}

async fn post(s: &Sluice, tenant: &str, max_tokens: u64) -> reqwest::Response {
    s.chat(tenant, body(max_tokens)).await
}

fn num(r: &reqwest::Response, name: &str) -> u64 {
    header(r, name)
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {:?}", header(r, name)))
}

async fn wait_quota_reachable(s: &Sluice, up: bool) {
    wait_for(
        Duration::from_secs(10),
        "the quota store's reachability",
        || async { (s.status().await["quotas"]["reachable"] == up).then_some(()) },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_guaranteed_tenant_over_its_shared_budget_is_demoted_not_refused_and_refills() {
    let ns = RedisNs::new(&shared_redis_url());
    let sim = fast_sim().await;
    let tenants = json!({GUARANTEED: {"tier": "Guaranteed", "quota": {"requests_per_minute": 60}}});
    let c = cfg(&sim, tenants, Some(&ns));
    let rs = [serve(&c.clone()).await, serve(&c).await];
    for s in &rs {
        wait_quota_reachable(s, true).await;
    }

    // Alternating replicas: one count-down, not one per replica.
    let started = Instant::now();
    let mut remaining = Vec::new();
    let mut demoted = None;
    for i in 0..130 {
        let r = post(&rs[i % 2], GUARANTEED, 2).await;
        assert_eq!(r.status(), 200, "never refused while Standard has room");
        assert_eq!(num(&r, "x-ratelimit-limit-requests"), 60);
        assert!(
            header(&r, "x-ratelimit-limit-tokens").is_empty(),
            "not configured"
        );
        if header(&r, "x-sluice-tier") == "Standard" {
            demoted = Some((i % 2, r));
            break;
        }
        assert_eq!(header(&r, "x-sluice-tier"), "Guaranteed");
        remaining.push(num(&r, "x-ratelimit-remaining-requests"));
    }
    let spent = started.elapsed().as_secs_f64();
    let (at, r) = demoted.expect("demoted once the budget ran out");
    println!(
        "served {} at Guaranteed over two replicas in {spent:.2} s, then demoted",
        remaining.len()
    );
    assert_eq!(remaining[0], 59);
    assert!(
        remaining.windows(2).all(|w| w[1] <= w[0]),
        "counts down across both replicas: {remaining:?}"
    );
    // One shared bucket of 60 (plus the refill while it was spent), not 60 per replica.
    let refilled = spent.ceil() as usize + 1;
    assert!(
        (60..=60 + refilled).contains(&remaining.len()),
        "{} served at Guaranteed in {spent:.2} s",
        remaining.len()
    );
    assert_eq!(header(&r, "x-sluice-decision"), "pass");
    assert_eq!(header(&r, "x-sluice-reason"), "demote_quota_exceeded");
    assert_eq!(header(&r, "x-sluice-demoted-from"), "Guaranteed");
    assert_eq!(num(&r, "x-ratelimit-remaining-requests"), 0);
    assert!(header(&r, "x-ratelimit-reset-requests").ends_with('s'));
    let id = header(&r, "x-request-id").to_string();
    let usage: Value = r.json().await.unwrap();
    assert!(
        usage["usage"]["completion_tokens"].as_u64().is_some(),
        "served"
    );

    let d = rs[at].record(&id).await;
    assert_eq!(d["tier"], "Standard", "{d}");
    assert_eq!(d["reason"], "demote_quota_exceeded");
    let metrics = rs[at].metrics().await;
    assert!(
        metrics
            .contains(r#"sluice_quota_demotions_total{served_as="Standard",tier="Guaranteed"} 1"#),
        "{metrics}"
    );
    let key = format!("{}:quota:{GUARANTEED}", ns.prefix);
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut ns.conn()).unwrap();
    assert!(
        (1..=61_000).contains(&ttl),
        "the key expires once full: {ttl}"
    );

    // One a second: served at its own tier again within about a second, demoted until then.
    let demoted_at = Instant::now();
    let back = wait_for(Duration::from_secs(3), "the refill", || async {
        let r = post(&rs[0], GUARANTEED, 2).await;
        assert_eq!(r.status(), 200);
        (header(&r, "x-sluice-tier") == "Guaranteed").then_some(demoted_at.elapsed())
    })
    .await;
    println!("back at Guaranteed {back:?} after the demotion");
    assert!(back <= Duration::from_secs(2), "{back:?}");

    let st = rs[1].status().await;
    let q = &st["quotas"];
    assert_eq!(q["store"], "redis");
    assert_eq!(q["fail_open"], false);
    assert_eq!(q["tenants"][0]["tenant"], GUARANTEED);
    assert_eq!(q["tenants"][0]["requests"]["limit_per_minute"], 60);
}

/// The usage of a long completion is charged when it ends: the next request is demoted until
/// the debt is paid back. Both stores: Redis (charges batched) and in-process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_completion_leaves_a_token_debt_and_the_next_request_is_demoted() {
    let ns = RedisNs::new(&shared_redis_url());
    let sim = fast_sim().await;
    // 600 a minute: ten tokens a second.
    let tenants = json!({STANDARD: {"tier": "Standard", "quota": {"tokens_per_minute": 600}}});
    for redis in [Some(&ns), None] {
        let s = serve(&cfg(&sim, tenants.clone(), redis)).await;
        if redis.is_some() {
            wait_quota_reachable(&s, true).await;
        }
        let r = post(&s, STANDARD, 1500).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-sluice-tier"), "Standard");
        let before = num(&r, "x-ratelimit-remaining-tokens");
        assert!(
            (500..600).contains(&before),
            "the prompt's estimate: {before}"
        );
        let done: Value = r.json().await.unwrap();
        assert_eq!(done["usage"]["completion_tokens"], 1500);

        let r = wait_for(
            Duration::from_secs(3),
            "the completion's charge",
            || async {
                let r = post(&s, STANDARD, 1).await;
                assert_eq!(r.status(), 200);
                (header(&r, "x-sluice-tier") == "Best-Effort").then_some(r)
            },
        )
        .await;
        assert_eq!(header(&r, "x-sluice-reason"), "demote_quota_exceeded");
        assert_eq!(header(&r, "x-sluice-demoted-from"), "Standard");
        assert_eq!(num(&r, "x-ratelimit-remaining-tokens"), 0);
        // About 900 tokens of debt at ten a second, plus 60 s to fill up: over two minutes.
        let reset = header(&r, "x-ratelimit-reset-tokens");
        assert!(
            reset.starts_with("2m") || reset.starts_with("3m"),
            "{reset}"
        );
        assert_eq!(header(&r, "x-sluice-pool"), "spot", "routed as Best-Effort");
        let st = s.status().await;
        let t = &st["quotas"]["tenants"][0];
        assert_eq!(t["over_budget"], true, "{st}");
        assert!(t["tokens"]["level"].as_f64().unwrap() < -800.0, "{t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn best_effort_over_budget_is_refused_with_retry_after_and_a_reload_raises_the_budget() {
    let sim = fast_sim().await;
    let quota = |rpm: u64| {
        json!({BEST_EFFORT: {"tier": "Best-Effort",
                             "quota": {"requests_per_minute": rpm, "tokens_per_minute": 100000}}})
    };
    let c = cfg(&sim, quota(2), None);
    let s = serve(&c).await;
    for left in [1, 0] {
        let r = post(&s, BEST_EFFORT, 2).await;
        assert_eq!(r.status(), 200);
        assert_eq!(num(&r, "x-ratelimit-remaining-requests"), left);
    }
    let r = post(&s, BEST_EFFORT, 2).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-sluice-decision"), "reject");
    assert_eq!(header(&r, "x-sluice-reason"), "reject_quota_exceeded");
    assert_eq!(header(&r, "x-sluice-tier"), "Best-Effort");
    let retry = num(&r, "retry-after");
    assert!((1..=30).contains(&retry), "two a minute: {retry}");
    assert_eq!(num(&r, "x-ratelimit-limit-requests"), 2);
    assert_eq!(num(&r, "x-ratelimit-remaining-requests"), 0);
    assert_eq!(num(&r, "x-ratelimit-limit-tokens"), 100000);
    assert!(num(&r, "x-ratelimit-remaining-tokens") > 99_000);
    assert!(header(&r, "x-ratelimit-reset-requests").ends_with('s'));
    let id = header(&r, "x-request-id").to_string();
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");
    assert_eq!(e["error"]["reason"], "reject_quota_exceeded");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("requests per minute (limit 2"), "{msg}");
    let d = s.record(&id).await;
    assert_eq!(d["tenant"], BEST_EFFORT);
    assert_eq!(d["decision"], "reject");
    assert_eq!(d["reason"], "reject_quota_exceeded");
    assert_eq!(d["status"], 429);

    // A read takes nothing and is never refused, but says where the budget stands.
    let r = client()
        .get(s.url("/v1/models"))
        .header("x-tenant-id", BEST_EFFORT)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-remaining-requests"), 0);
    // A tenant without a budget gets none of it.
    let r = post(&s, STANDARD, 2).await;
    assert!(header(&r, "x-ratelimit-limit-requests").is_empty());

    // SIGHUP with a larger budget: ten a second refill from now on.
    let path = s.dir.join("sluice.yaml");
    let mut raised: Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    merge(&mut raised, json!({"tenants": quota(600)}));
    std::fs::write(&path, serde_yaml::to_string(&raised).unwrap()).unwrap();
    let ok = std::process::Command::new("kill")
        .args(["-HUP", &s.pid().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let r = wait_for(Duration::from_secs(5), "the raised budget", || async {
        let r = post(&s, BEST_EFFORT, 2).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert_eq!(num(&r, "x-ratelimit-limit-requests"), 600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_outage_fails_open_to_this_replicas_buckets() {
    let port = free_port();
    let mut redis = PrivateRedis::start(port).await;
    let ns = RedisNs::new(&format!("redis://127.0.0.1:{port}"));
    let sim = fast_sim().await;
    let tenants = json!({GUARANTEED: {"tier": "Guaranteed", "quota": {"requests_per_minute": 60}}});
    let s = serve(&cfg(&sim, tenants, Some(&ns))).await;
    wait_quota_reachable(&s, true).await;
    let mut last = 60;
    for _ in 0..5 {
        let r = post(&s, GUARANTEED, 2).await;
        assert_eq!(r.status(), 200);
        last = num(&r, "x-ratelimit-remaining-requests");
    }
    assert!(last <= 56, "{last}");

    redis.stop();
    for _ in 0..10 {
        let r = post(&s, GUARANTEED, 2).await;
        assert_eq!(r.status(), 200, "served while Redis is down");
        assert_eq!(header(&r, "x-sluice-tier"), "Guaranteed");
        let now = num(&r, "x-ratelimit-remaining-requests");
        assert!(
            now < last + 1,
            "continues from the shared state: {now} after {last}"
        );
        last = now;
    }
    let q = s.status().await["quotas"].clone();
    assert_eq!(q["fail_open"], true, "{q}");
    assert!(q["fail_open_total"].as_u64().unwrap() >= 1, "{q}");
    assert!(q["last_error"].is_string(), "{q}");

    // Back: budgets are shared again.
    let _redis = PrivateRedis::start(port).await;
    wait_quota_reachable(&s, true).await;
    let r = post(&s, GUARANTEED, 2).await;
    assert_eq!(r.status(), 200);
    let live = client().get(s.ops_url("/livez")).send().await.unwrap();
    assert_eq!(live.status(), 200);
    assert!(!s.log().contains("panicked"), "{}", s.log());
}
