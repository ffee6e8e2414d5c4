//! Budgets shared by every replica on one Redis: one hash per tenant (`<prefix>:quota:<tenant>`)
//! changed only by Lua scripts (`lua/*.lua`), so refill + check + take is atomic across
//! replicas, with Redis's `TIME` as the clock. A key expires once its bucket would be full
//! again, so idle tenants leave nothing behind.
//!
//! The check-and-take is on the request path (one EVALSHA); completion-token charges and
//! refunds leave fire-and-forget through a batcher (all that piled up while one batch was on
//! the wire go in the next, one script call for all of them). Every call is bounded by
//! `coordination.op_timeout_ms`. A failed call marks Redis unreachable: the caller falls back to
//! the in-process buckets, and requests stop asking Redis until the background probe reaches it
//! again (every 250 ms), so an outage costs them nothing but that first bound.

use crate::redis_link::{Messages, RedisError, RedisLink, Retry};
use redis::Script;
use sluice_config::QuotaConfig;
use sluice_policy::bucket::{Dim, Verdict};
use std::sync::LazyLock;
use std::time::Duration;

/// How often the background task probes Redis and refreshes the `/status` copy.
pub const REFRESH_EVERY: Duration = Duration::from_millis(250);
/// Most tenants one charge or peek call carries, so each call stays short.
const BATCH_MAX: usize = 256;

macro_rules! lua {
    ($file:literal) => {
        concat!(
            include_str!("../redis_clock.lua"),
            "\n",
            include_str!("lua/prelude.lua"),
            "\n",
            include_str!(concat!("lua/", $file))
        )
    };
}

struct Scripts {
    take: Script,
    charge: Script,
    peek: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    take: Script::new(lua!("take.lua")),
    charge: Script::new(lua!("charge.lua")),
    peek: Script::new(lua!("peek.lua")),
});

/// A charge on its way to Redis: signed deltas (negative spends, positive refunds).
#[derive(Debug, Clone)]
pub struct Charge {
    pub tenant: String,
    pub quota: QuotaConfig,
    pub requests: f64,
    pub tokens: f64,
}

pub struct RedisQuota {
    /// Requests ask Redis only while it is reachable.
    link: RedisLink,
    prefix: String,
}

fn args(q: &QuotaConfig) -> (u64, u64) {
    (
        q.requests_per_minute.unwrap_or(0),
        q.tokens_per_minute.unwrap_or(0),
    )
}

/// A level as the scripts return it ('' when the dimension has no limit).
fn dim(limit: Option<u64>, level: &str) -> Result<Option<Dim>, RedisError> {
    let Some(limit) = limit else {
        return Ok(None);
    };
    let level = level
        .parse::<f64>()
        .map_err(|_| RedisError::Reply(format!("unexpected bucket level {level:?}")))?;
    Ok(Some(Dim { limit, level }))
}

impl RedisQuota {
    pub fn new(url: &str, prefix: &str, op_timeout: Duration) -> Result<Self, String> {
        let link = RedisLink::open(
            url,
            op_timeout,
            REFRESH_EVERY,
            vec![&SCRIPTS.take, &SCRIPTS.charge, &SCRIPTS.peek],
            // A charge is not idempotent: a call whose reply was lost may have run.
            Retry::Refused,
            Messages {
                up: "redis quota store reachable: budgets are shared again",
                down: "redis quota store unreachable, budgets fall back to this replica",
            },
        )?;
        Ok(Self {
            link,
            prefix: format!("{prefix}:quota:"),
        })
    }

    fn key(&self, tenant: &str) -> String {
        format!("{}{tenant}", self.prefix)
    }

    pub fn reachable(&self) -> bool {
        self.link.reachable()
    }

    pub fn last_error(&self) -> Option<String> {
        self.link.last_error()
    }

    /// Connects (one attempt) and loads the scripts, so request-path calls are plain EVALSHA.
    pub async fn connect(&self) -> Result<(), RedisError> {
        self.link.connect().await
    }

    pub fn connected(&self) -> bool {
        self.link.connected()
    }

    /// The atomic check-and-take.
    pub async fn take(
        &self,
        tenant: &str,
        q: &QuotaConfig,
        tokens: u64,
    ) -> Result<Verdict, RedisError> {
        let (rpm, tpm) = args(q);
        let mut inv = SCRIPTS.take.prepare_invoke();
        inv.key(self.key(tenant)).arg(rpm).arg(tpm).arg(tokens);
        let (room, r, t): (i64, String, String) = self.link.call(&inv).await?;
        Ok(Verdict {
            room: room == 1,
            requests: dim(q.requests_per_minute, &r)?,
            tokens: dim(q.tokens_per_minute, &t)?,
        })
    }

    /// Applies a batch of charges in one call (several charges of one tenant add up).
    pub async fn charge(&self, batch: &[Charge]) -> Result<(), RedisError> {
        let mut inv = SCRIPTS.charge.prepare_invoke();
        for c in batch {
            let (rpm, tpm) = args(&c.quota);
            inv.key(self.key(&c.tenant))
                .arg(rpm)
                .arg(tpm)
                .arg(c.requests)
                .arg(c.tokens);
        }
        self.link.call::<i64>(&inv).await.map(|_| ())
    }

    /// Every given bucket as of now, unchanged.
    pub async fn peek(
        &self,
        tenants: &[(String, QuotaConfig)],
    ) -> Result<Vec<Verdict>, RedisError> {
        let mut out = Vec::with_capacity(tenants.len());
        for chunk in tenants.chunks(BATCH_MAX) {
            let mut inv = SCRIPTS.peek.prepare_invoke();
            for (t, q) in chunk {
                let (rpm, tpm) = args(q);
                inv.key(self.key(t)).arg(rpm).arg(tpm);
            }
            let levels: Vec<String> = self.link.call(&inv).await?;
            for ((_, q), pair) in chunk.iter().zip(levels.chunks(2)) {
                let [r, t] = pair else {
                    return Err(RedisError::Reply("short peek answer".into()));
                };
                let mut v = Verdict {
                    room: false,
                    requests: dim(q.requests_per_minute, r)?,
                    tokens: dim(q.tokens_per_minute, t)?,
                };
                v.room = v.dims().all(|(_, d)| d.level >= 1.0);
                out.push(v);
            }
        }
        Ok(out)
    }
}

/// Sends charges in batches: waits for one, takes whatever else is already queued (up to
/// [`BATCH_MAX`]), sends them in one call, repeats. What Redis did not take (it is down) goes
/// to `fallback`, the in-process buckets, so a fail-open replica still sees the debt.
pub async fn charge_batches(
    store: std::sync::Weak<RedisQuota>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Charge>,
    fallback: impl Fn(&Charge),
) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, BATCH_MAX).await > 0 {
        let Some(store) = store.upgrade() else {
            return;
        };
        if !store.reachable() || store.charge(&batch).await.is_err() {
            batch.iter().for_each(&fallback);
        }
        batch.clear();
    }
}

/// The scripts against a real Redis (`SLUICE_TEST_REDIS_URL`, default 127.0.0.1:6379), each
/// test under its own random prefix, deleted at the end.
#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hasher};

    fn test_url() -> String {
        std::env::var("SLUICE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    struct Ns(String);

    impl Ns {
        fn new() -> Self {
            let n = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            Ns(format!("sluice-test-{n:016x}"))
        }

        fn conn(&self) -> redis::Connection {
            redis::Client::open(test_url())
                .unwrap()
                .get_connection()
                .expect("these tests need a Redis at SLUICE_TEST_REDIS_URL or 127.0.0.1:6379")
        }
    }

    impl Drop for Ns {
        fn drop(&mut self) {
            let mut c = self.conn();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{}:*", self.0))
                .query(&mut c)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut c);
            }
        }
    }

    fn q(rpm: Option<u64>, tpm: Option<u64>) -> QuotaConfig {
        QuotaConfig {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    async fn store(ns: &Ns) -> RedisQuota {
        let s = RedisQuota::new(&test_url(), &ns.0, Duration::from_millis(500)).unwrap();
        s.connect().await.unwrap();
        s
    }

    #[tokio::test]
    async fn take_charge_and_peek_share_one_bucket_that_expires_when_full() {
        let ns = Ns::new();
        let s = store(&ns).await;
        let q = q(Some(3), Some(1000));
        let v = s.take("t", &q, 100).await.unwrap();
        assert!(v.room);
        assert_eq!(v.requests.unwrap().remaining(), 2);
        assert!((v.tokens.unwrap().level - 900.0).abs() < 1.0);
        s.take("t", &q, 0).await.unwrap();
        s.take("t", &q, 0).await.unwrap();
        let v = s.take("t", &q, 0).await.unwrap();
        assert!(!v.room, "three requests a minute");
        assert!(v.requests.unwrap().level < 1.0);

        // A long completion, then a refund of one request refused after its take.
        let charge = |requests, tokens| Charge {
            tenant: "t".into(),
            quota: q,
            requests,
            tokens,
        };
        s.charge(&[charge(0.0, -2500.0), charge(1.0, 0.0)])
            .await
            .unwrap();
        let [v] = s.peek(&[("t".into(), q)]).await.unwrap()[..] else {
            panic!("one bucket")
        };
        assert!(v.tokens.unwrap().level < -1500.0, "in debt: {v:?}");
        assert!(v.requests.unwrap().level >= 1.0, "refunded: {v:?}");
        assert!(!v.room);

        let mut c = ns.conn();
        let key = format!("{}:quota:t", ns.0);
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut c).unwrap();
        // Tokens are the furthest from full: ~2600 of 1000/min is ~156 s.
        assert!((150_000..=160_000).contains(&ttl), "ttl {ttl}");

        // An unknown tenant reads full and leaves no key.
        let v = s.peek(&[("idle".into(), q)]).await.unwrap()[0];
        assert_eq!(v.requests.unwrap().level, 3.0);
        let exists: i64 = redis::cmd("EXISTS")
            .arg(format!("{}:quota:idle", ns.0))
            .query(&mut c)
            .unwrap();
        assert_eq!(exists, 0);
    }

    #[tokio::test]
    async fn the_bucket_refills_on_redis_time() {
        let ns = Ns::new();
        let s = store(&ns).await;
        let q = q(Some(600), None); // ten a second
        let started = std::time::Instant::now();
        for _ in 0..600 {
            assert!(s.take("t", &q, 0).await.unwrap().room);
        }
        let v = s.take("t", &q, 0).await.unwrap();
        // Emptied but for what refilled while the 600 took (a loaded machine takes seconds).
        let refilled = started.elapsed().as_secs_f64() * 10.0;
        assert!(
            !v.room || v.requests.unwrap().level < refilled + 1.0,
            "{v:?} after {refilled:.1} requests' refill"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(s.take("t", &q, 0).await.unwrap().room, "refilled");
    }

    #[tokio::test]
    async fn an_unreachable_redis_answers_within_the_bound() {
        let s =
            RedisQuota::new("redis://127.0.0.1:1", "unused", Duration::from_millis(100)).unwrap();
        assert!(s.connect().await.is_err());
        let started = std::time::Instant::now();
        assert!(s.take("t", &q(Some(1), None), 0).await.is_err());
        assert!(started.elapsed() < Duration::from_millis(50));
        assert!(!s.reachable());
        assert!(s.last_error().unwrap().contains("not connected"));
    }
}
