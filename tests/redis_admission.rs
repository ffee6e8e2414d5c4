//! The Redis coordinator across several coordinators ("replicas") in one process, against the
//! real Redis (`SLUICE_TEST_REDIS_URL`, default 127.0.0.1:6379; each test in its own key
//! prefix, deleted at the end). The outage test stops only its own private `redis-server`.

mod common;
use common::{free_port, shared_redis_url, PrivateRedis, RedisNs};
use sluice_policy::{Reason, Tier};
use sluice_runtime::admission::{
    Admission, AdmissionControl, QueueParams, RedisAdmission, RedisSettings, SharedStoreHealth,
};
use std::process::Command;
use std::time::{Duration, Instant};

fn test_url() -> String {
    shared_redis_url()
}

/// The shared namespace helper with the coordinator-level conveniences these tests use.
type Ns = RedisNs;

trait NsExt {
    fn zcount(&self, tier: Tier, kind: &str) -> u64;
    async fn coordinator(&self, replica: &str, lease_ms: u64) -> RedisAdmission;
    async fn coordinator_with(&self, replica: &str, lease_ms: u64, op_ms: u64) -> RedisAdmission;
    async fn coordinator_full(
        &self,
        replica: &str,
        lease_ms: u64,
        op_ms: u64,
        credits: bool,
    ) -> RedisAdmission;
    async fn wait_empty(&self, tier: Tier, kind: &str);
}

impl NsExt for Ns {
    fn zcount(&self, tier: Tier, kind: &str) -> u64 {
        self.zcard(tier.as_str(), kind).expect("Redis reachable")
    }

    async fn coordinator(&self, replica: &str, lease_ms: u64) -> RedisAdmission {
        // Generous: a loaded test machine must not turn a slow call into a fail-open.
        self.coordinator_with(replica, lease_ms, 1000).await
    }

    async fn coordinator_with(&self, replica: &str, lease_ms: u64, op_ms: u64) -> RedisAdmission {
        self.coordinator_full(replica, lease_ms, op_ms, false).await
    }

    async fn coordinator_full(
        &self,
        replica: &str,
        lease_ms: u64,
        op_ms: u64,
        credits: bool,
    ) -> RedisAdmission {
        let a = RedisAdmission::new(RedisSettings {
            url: self.url.clone(),
            prefix: self.prefix.clone(),
            lease: Duration::from_millis(lease_ms),
            op_timeout: Duration::from_millis(op_ms),
            replica: replica.into(),
            capacities: [0; 3],
            fair_share: Default::default(),
            credits,
        })
        .unwrap();
        a.connect().await.unwrap();
        a
    }

    /// Releases are spawned from `Slot::drop`; wait for them to land.
    async fn wait_empty(&self, tier: Tier, kind: &str) {
        let start = Instant::now();
        while self.zcount(tier, kind) != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(3),
                "{kind} of {tier} still holds {}",
                self.zcount(tier, kind)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The Redis coordinator's store health (it always has one).
fn store(a: &RedisAdmission) -> SharedStoreHealth {
    a.health()
        .shared
        .expect("the Redis coordinator reports its store")
}

fn q(max_size: usize, wait_ms: u64) -> Option<QueueParams> {
    Some(QueueParams {
        max_size,
        max_wait: Duration::from_millis(wait_ms),
        poll: Duration::from_millis(10),
    })
}

fn outcome(a: &Admission) -> Result<bool, Reason> {
    match a {
        Admission::Admitted { fail_open, .. } => Ok(*fail_open),
        Admission::Refused { reason, .. } => Err(*reason),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_coordinators_capacity_one_exactly_one_wins() {
    let ns = Ns::new(&test_url());
    let a = ns.coordinator("a", 5000).await;
    let b = ns.coordinator("b", 5000).await;
    for round in 0..50 {
        let (ra, rb) = tokio::join!(
            a.admit(Tier::Standard, 1, None),
            b.admit(Tier::Standard, 1, None)
        );
        let mut results = [outcome(&ra).is_ok(), outcome(&rb).is_ok()];
        results.sort();
        assert_eq!(results, [false, true], "round {round}");
        for r in [&ra, &rb] {
            if let Err(reason) = outcome(r) {
                assert_eq!(reason, Reason::TierAtCapacity);
            }
        }
        assert_eq!(ns.zcount(Tier::Standard, "slots"), 1);
        drop((ra, rb));
        ns.wait_empty(Tier::Standard, "slots").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifo_order_holds_across_coordinators() {
    let ns = Ns::new(&test_url());
    let cs = [
        ns.coordinator("a", 5000).await,
        ns.coordinator("b", 5000).await,
        ns.coordinator("c", 5000).await,
    ];
    let held = cs[0].admit(Tier::Standard, 1, None).await;
    assert_eq!(outcome(&held), Ok(false));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = cs[i % 3].clone();
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let r = c.admit(Tier::Standard, 1, q(20, 5000)).await;
            assert_eq!(outcome(&r), Ok(false), "waiter {i}");
            tx.send(i).unwrap();
            tokio::time::sleep(Duration::from_millis(15)).await;
            drop(r);
        }));
        // Arrival order is what FIFO promises; space the arrivals out so it is unambiguous.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(ns.zcount(Tier::Standard, "queue"), 8);
    drop(held);
    let mut order = Vec::new();
    for _ in 0..8 {
        order.push(rx.recv().await.unwrap());
    }
    assert_eq!(order, (0..8).collect::<Vec<_>>());
    for t in tasks {
        t.await.unwrap();
    }
    ns.wait_empty(Tier::Standard, "slots").await;
    assert_eq!(ns.zcount(Tier::Standard, "queue"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_bound_holds_across_coordinators_and_timed_out_entries_are_removed() {
    let ns = Ns::new(&test_url());
    let cs = [
        ns.coordinator("a", 5000).await,
        ns.coordinator("b", 5000).await,
        ns.coordinator("c", 5000).await,
    ];
    let held = cs[0].admit(Tier::Standard, 1, None).await;
    let mut tasks = Vec::new();
    for i in 0..7 {
        let c = cs[i % 3].clone();
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let r = c.admit(Tier::Standard, 1, q(3, 600)).await;
            (outcome(&r), started.elapsed())
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(ns.zcount(Tier::Standard, "queue") <= 3, "bound exceeded");
    }
    let mut dropped = 0;
    let mut timed_out = 0;
    for t in tasks {
        match t.await.unwrap() {
            (Err(Reason::QueueDropped), waited) => {
                dropped += 1;
                assert!(waited < Duration::from_millis(100), "dropped at once");
            }
            (Err(Reason::QueueTimedOut), waited) => {
                timed_out += 1;
                // Deadlines are whole milliseconds of Redis's clock, so one may fall due
                // up to a millisecond before the client's own 600 ms have passed.
                assert!(
                    waited >= Duration::from_millis(599),
                    "gave up after {waited:?}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((timed_out, dropped), (3, 4));
    // Each timed-out waiter removed its own entry before answering.
    assert_eq!(ns.zcount(Tier::Standard, "queue"), 0);
    assert_eq!(ns.zcount(Tier::Standard, "deadlines"), 0);

    // A waiter whose replica died mid-wait blocks the head only until its deadline.
    let mut c = ns.conn();
    let queue = format!("{}:Standard:queue", ns.prefix);
    let deadlines = format!("{}:Standard:deadlines", ns.prefix);
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(&queue)
        .arg(0)
        .arg("dead:q1")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(&deadlines)
        .arg(secs * 1000 + micros / 1000 + 300)
        .arg("dead:q1")
        .query(&mut c)
        .unwrap();
    // Its tenant's own queue and place among the waiting tenants, as enqueue.lua left them.
    let base = format!("{}:Standard", ns.prefix);
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(format!("{base}:wt"))
        .arg("dead:q1")
        .arg("ghost")
        .cmd("ZADD")
        .arg(format!("{base}:tq:ghost"))
        .arg(0)
        .arg("dead:q1")
        .cmd("ZADD")
        .arg(format!("{base}:backlog"))
        .arg(0)
        .arg("ghost")
        .query(&mut c)
        .unwrap();
    drop(held);
    let started = Instant::now();
    let r = cs[1].admit(Tier::Standard, 1, q(3, 2000)).await;
    assert_eq!(outcome(&r), Ok(false));
    let waited = started.elapsed();
    assert!(
        (Duration::from_millis(200)..Duration::from_millis(1000)).contains(&waited),
        "admitted after the dead head's deadline, waited {waited:?}"
    );
    drop(r);
    ns.wait_empty(Tier::Standard, "slots").await;
    assert_eq!(ns.zcount(Tier::Standard, "queue"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_coordinators_slots_are_reclaimed_within_the_lease() {
    let ns = Ns::new(&test_url());
    let lease = 600;
    let dying = ns.coordinator("dying", lease).await;
    let survivor = ns.coordinator("survivor", lease).await;
    let _bg = survivor.spawn_background();
    // `dying` never runs its renewal task, which is what a killed replica looks like; its
    // slots are leaked on purpose (forgotten, never released).
    for _ in 0..2 {
        let r = dying.admit(Tier::Standard, 2, None).await;
        assert_eq!(outcome(&r), Ok(false));
        std::mem::forget(r);
    }
    // The survivor's own slot is renewed past several lease periods.
    let mine = survivor.admit(Tier::Standard, 3, None).await;
    assert_eq!(outcome(&mine), Ok(false));
    let died = Instant::now();
    assert_eq!(
        outcome(&survivor.admit(Tier::Standard, 3, None).await),
        Err(Reason::TierAtCapacity)
    );
    let reclaimed = loop {
        let r = survivor.admit(Tier::Standard, 3, None).await;
        if outcome(&r).is_ok() {
            break (r, died.elapsed());
        }
        assert!(died.elapsed() < Duration::from_secs(3), "never reclaimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("dead coordinator's slots returned after {:?}", reclaimed.1);
    assert!(reclaimed.1 <= Duration::from_millis(lease + 100));
    // The two leaked leases were taken milliseconds apart, so the admit that succeeded may
    // have found only the first one expired; the second goes back on the next script run.
    while store(&survivor).reclaimed_leases_total != 2 {
        assert!(
            died.elapsed() < Duration::from_millis(lease + 500),
            "second leaked lease not reclaimed: {:?}",
            survivor.health()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(3 * lease)).await;
    assert_eq!(
        ns.zcount(Tier::Standard, "slots"),
        2,
        "live leases were renewed"
    );
    assert_eq!(store(&survivor).lost_leases_total, 0);
    drop((mine, reclaimed));
    ns.wait_empty(Tier::Standard, "slots").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_fails_open_visibly_and_admission_returns_to_redis() {
    let mut redis = PrivateRedis::start(free_port()).await;
    let ns = Ns::new(&format!("redis://127.0.0.1:{}", redis.port));
    let a = ns.coordinator_with("a", 1500, 250).await;
    let _bg = a.spawn_background();
    let held = a.admit(Tier::Standard, 1, None).await;
    assert_eq!(outcome(&held), Ok(false));
    assert_eq!(
        outcome(&a.admit(Tier::Standard, 1, None).await),
        Err(Reason::TierAtCapacity)
    );

    redis.stop();
    let mut during = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let r = a.admit(Tier::Standard, 1, q(10, 1000)).await;
        assert_eq!(outcome(&r), Ok(true), "fails open while Redis is down");
        assert!(started.elapsed() < Duration::from_millis(300), "bounded");
        during.push(r);
    }
    let h = store(&a);
    assert!(!h.reachable);
    assert_eq!(h.fail_open_total, 5);
    assert_eq!(h.fail_open_inflight, 5);
    assert!(h.last_error.is_some());
    drop(during);
    drop(held);
    assert_eq!(store(&a).fail_open_inflight, 0);

    let redis = PrivateRedis::start(redis.port).await;
    let redis_pid = redis.child.id();
    let start = Instant::now();
    while !store(&a).reachable {
        assert!(start.elapsed() < Duration::from_secs(5), "reconnects");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "admission back on Redis {:?} after restart",
        start.elapsed()
    );
    let r = a.admit(Tier::Standard, 1, None).await;
    assert_eq!(outcome(&r), Ok(false), "enforced again: {:?}", a.health());
    assert_eq!(
        outcome(&a.admit(Tier::Standard, 1, None).await),
        Err(Reason::TierAtCapacity)
    );
    drop(r);
    ns.wait_empty(Tier::Standard, "slots").await;
    assert_eq!(store(&a).held_slots, 0);
    assert_eq!(store(&a).fail_open_total, 5);

    // A hung Redis (stopped, connection open) costs one op timeout, then nothing.
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &redis_pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    signal("-STOP");
    let started = Instant::now();
    let r = a.admit(Tier::Standard, 1, None).await;
    let first = started.elapsed();
    assert_eq!(outcome(&r), Ok(true));
    assert!(
        first < Duration::from_millis(400),
        "bounded by the op timeout: {first:?}"
    );
    let started = Instant::now();
    let r2 = a.admit(Tier::Standard, 1, None).await;
    assert_eq!(outcome(&r2), Ok(true));
    let second = started.elapsed();
    assert!(
        second < Duration::from_millis(20),
        "then immediate: {second:?}"
    );
    println!("hung Redis: first admission {first:?}, next {second:?}");
    drop((r, r2));
    signal("-CONT");
    let start = Instant::now();
    while !store(&a).reachable {
        assert!(start.elapsed() < Duration::from_secs(5), "recovers");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The hung call reached Redis once it resumed and took a slot; its attempt's cleanup gives
    // it back.
    ns.wait_empty(Tier::Standard, "slots").await;
    assert_eq!(
        outcome(&a.admit(Tier::Standard, 1, None).await),
        Ok(false),
        "enforced again"
    );
    ns.wait_empty(Tier::Standard, "slots").await;
}

fn load(yaml: &str, env: &[(&str, &str)]) -> Result<sluice_config::Config, String> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    sluice_config::Config::from_yaml(yaml, "test.yaml", std::path::Path::new("."), None, &lookup)
        .map_err(|e| e.to_string())
}

#[test]
fn coordination_config_defaults_overrides_and_validation() {
    let c = load("{}", &[]).unwrap();
    assert_eq!(c.coordination.redis_prefix, "sluice");
    assert_eq!(c.coordination.lease_seconds, 5.0);
    assert_eq!(c.coordination.op_timeout_ms, 250);
    let (a, services) = sluice_runtime::admission::build(&c).unwrap();
    assert_eq!((a.kind(), services.len()), ("local", 0));

    let c = load(
        "coordination: {redis_prefix: prod-a, lease_seconds: 2}",
        &[
            ("SLUICE_REDIS_URL", "redis://10.0.0.5:6379"),
            ("SLUICE_REDIS_PREFIX", "prod-b"),
        ],
    )
    .unwrap();
    assert_eq!(c.coordination.redis_prefix, "prod-b", "env over file");
    assert_eq!(c.coordination.lease_ms(), 2000);
    let (a, services) = sluice_runtime::admission::build(&c).unwrap();
    assert_eq!((a.kind(), services.len()), ("redis", 1));
    assert!(!a.health().healthy, "not connected before start");

    for (yaml, expected) in [
        (
            "coordination: {redis_prefix: 'a b'}",
            "test.yaml: coordination.redis_prefix:",
        ),
        (
            "coordination: {lease_seconds: 0}",
            "test.yaml: coordination.lease_seconds:",
        ),
        (
            "coordination: {lease_seconds: 0.5}",
            "test.yaml: coordination.lease_seconds: 0.5 s is shorter than 3 x",
        ),
        (
            "coordination: {op_timeout_ms: 0}",
            "test.yaml: coordination.op_timeout_ms:",
        ),
        (
            "redis_url: 'http://x'",
            "test.yaml: redis_url: not a usable Redis URL",
        ),
        ("coordination: {leases: 3}", "unknown field `leases`"),
    ] {
        let e = load(yaml, &[]).unwrap_err();
        assert!(e.contains(expected), "{yaml}: {e}");
    }
}

/// Capacity credits: far from the bound, most admissions are served from a replica's leased
/// block without a Redis round trip; the bound stays exact (credits are slots), and near it the
/// idle credits go back so one replica can still fill the tier to the last slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn credits_spare_round_trips_far_from_the_bound_and_keep_it_exact() {
    const CAP: u32 = 128;
    let ns = Ns::new(&test_url());
    let mut cs = Vec::new();
    for r in ["a", "b", "c"] {
        let c = ns.coordinator_full(r, 5000, 1000, true).await;
        c.spawn_background();
        cs.push(c);
    }
    // Steady traffic well below the bound: admit and finish, over and over.
    for _ in 0..200 {
        for c in &cs {
            let a = c.admit(Tier::Guaranteed, CAP, None).await;
            assert_eq!(outcome(&a), Ok(false));
            drop(a);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let served_from_credits: u64 = cs.iter().map(|c| store(c).credit_admissions_total).sum();
    assert!(
        served_from_credits >= 500,
        "{served_from_credits} of 600 admissions came from credits"
    );
    assert!(ns.zcount(Tier::Guaranteed, "slots") <= u64::from(CAP) / 2);

    // Fill the tier from all three: the bound never gives, whoever holds the credits.
    let mut held = Vec::new();
    let mut refusals = 0;
    while refusals < 30 {
        let c = &cs[held.len() % 3];
        match c.admit(Tier::Guaranteed, CAP, None).await {
            a @ Admission::Admitted { .. } => held.push(a),
            Admission::Refused { .. } => {
                refusals += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        assert!(held.len() <= CAP as usize, "bound exceeded");
        assert!(ns.zcount(Tier::Guaranteed, "slots") <= u64::from(CAP));
    }
    // Contended: the idle credits went back, so the tier filled to its last slot.
    assert_eq!(held.len(), CAP as usize);
    assert!(cs.iter().all(|c| store(c).idle_credits == 0));
    drop(held);
    for c in &cs {
        c.retire_credits().await;
    }
    ns.wait_empty(Tier::Guaranteed, "slots").await;
}
