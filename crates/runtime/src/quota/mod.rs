//! Per-tenant budgets that demote instead of refusing (`tenants.<name>.quota`).
//!
//! A tenant with a budget has a token bucket per configured dimension ([`bucket`]): requests
//! per minute (one per admitted completion) and tokens per minute (the prompt estimated at
//! admission, the completion counted from the response's usage when it ends). A tenant whose
//! bucket is empty is served as the next lower tier (Guaranteed → Standard → Best-Effort), and
//! refused only where that tier refuses; Best-Effort has no lower tier and is refused (429
//! `reject_quota_exceeded`). A demoted request is not charged: the budget measures what the
//! tenant consumed at its own tier.
//!
//! With `redis_url` the buckets are shared by every replica ([`redis`]); without it, or while
//! Redis is unreachable, they live in this process ([`local`]). Tenants without a budget never
//! reach this module.

mod local;
mod redis;
mod ticket;

pub use sluice_policy::bucket::{openai_duration, Dim, Verdict};
pub use ticket::{lower, Ticket};

use self::redis::{charge_batches, Charge, RedisQuota, REFRESH_EVERY};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use local::LocalBuckets;
use pingora::server::ShutdownWatch;
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::ServiceWithDependents;
use serde::Serialize;
use sluice_config::{Config, QuotaConfig};
use sluice_policy::Tier;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// Consecutive failed refreshes after which a fresh connection is tried (a connection that
/// hangs without ever erroring).
const RECONNECT_AFTER_FAILURES: u32 = 8;

/// The budget store: in-process buckets, plus Redis when configured.
pub struct Quotas {
    local: Arc<LocalBuckets>,
    redis: Option<Arc<RedisQuota>>,
    /// Tenants that have a budget, for `/status` and its refresh; swapped on reload.
    budgets: ArcSwap<Vec<(String, QuotaConfig)>>,
    /// How many of them `/status` lists and the refresh reads (`metrics.max_tenants`).
    max_listed: AtomicUsize,
    charges: Option<UnboundedSender<Charge>>,
    /// Taken by the background task, which sends the charges to Redis.
    charges_rx: Mutex<Option<UnboundedReceiver<Charge>>>,
    fail_open_total: AtomicU64,
    refreshed_at: Mutex<Option<Instant>>,
}

/// The store and the background services to register with the server.
pub type Store = (Arc<Quotas>, Vec<Box<dyn ServiceWithDependents>>);

/// The store the config asks for and the background service it needs (with Redis: the charge
/// batcher and the probe that refreshes `/status` and finds Redis again after an outage).
pub fn build(cfg: &Config) -> Result<Store, String> {
    let redis = match cfg.redis_url.as_deref() {
        None => None,
        Some(url) => Some(Arc::new(RedisQuota::new(
            url,
            &cfg.coordination.redis_prefix,
            Duration::from_millis(cfg.coordination.op_timeout_ms),
        )?)),
    };
    let quotas = Arc::new(Quotas::new(redis));
    quotas.configure(cfg);
    let services: Vec<Box<dyn ServiceWithDependents>> = match quotas.redis {
        None => Vec::new(),
        Some(_) => vec![Box::new(background_service(
            "redis quotas",
            Background(Arc::clone(&quotas)),
        ))],
    };
    Ok((quotas, services))
}

impl Quotas {
    /// In-process buckets only.
    pub fn local() -> Self {
        Self::new(None)
    }

    fn new(redis: Option<Arc<RedisQuota>>) -> Self {
        let (tx, rx) = match redis {
            Some(_) => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        Self {
            local: Arc::default(),
            redis,
            budgets: ArcSwap::from_pointee(Vec::new()),
            max_listed: AtomicUsize::new(100),
            charges: tx,
            charges_rx: Mutex::new(rx),
            fail_open_total: AtomicU64::new(0),
            refreshed_at: Mutex::default(),
        }
    }

    /// Takes the tenants' budgets from a (re)loaded config. Limits travel with each request's
    /// identity, so a changed budget applies from the next request; this refreshes the list
    /// `/status` shows and forgets the buckets of tenants whose budget was removed.
    pub fn configure(&self, cfg: &Config) {
        let budgets: Vec<(String, QuotaConfig)> = cfg
            .tenants
            .iter()
            .filter_map(|(name, t)| Some((name.clone(), t.quota?)))
            .collect();
        self.local
            .retain(&budgets.iter().map(|(t, _)| t.as_str()).collect());
        self.max_listed
            .store(cfg.metrics.max_tenants, Ordering::Relaxed);
        self.budgets.store(Arc::new(budgets));
    }

    /// The budget check of one request. `prompt_tokens` is `Some` for a completion, which takes
    /// one request and its prompt; anything else only reads the buckets (for the headers) and
    /// is never demoted.
    pub async fn admit(
        &self,
        tenant: &str,
        quota: QuotaConfig,
        tier: Tier,
        prompt_tokens: Option<u64>,
    ) -> Ticket {
        let verdict = match prompt_tokens {
            None => self.local.peek(tenant, &quota),
            Some(tokens) => self.take(tenant, &quota, tokens).await,
        };
        let over = prompt_tokens.is_some() && !verdict.room;
        let served = if over { lower(tier) } else { Some(tier) };
        Ticket {
            quota,
            verdict,
            home: tier,
            served: served.unwrap_or(tier),
            refused: served.is_none(),
            taken_tokens: prompt_tokens.filter(|_| !over),
        }
    }

    async fn take(&self, tenant: &str, q: &QuotaConfig, tokens: u64) -> Verdict {
        if let Some(r) = self.redis.as_ref().filter(|r| r.reachable()) {
            if let Ok(v) = r.take(tenant, q, tokens).await {
                // The last shared state, for the headers of reads and for a fail-open that
                // continues from it rather than from a full bucket.
                self.local.mirror(tenant, q, &v);
                return v;
            }
        }
        if self.redis.is_some() {
            self.fail_open_total.fetch_add(1, Ordering::Relaxed);
        }
        self.local.take(tenant, q, tokens)
    }

    /// The end of a request that took from its budget: a served one is charged its completion
    /// tokens; one refused after its take (by the policy or capacity) gets its take back.
    /// Never waits: Redis charges leave through the batcher.
    pub fn settle(&self, tenant: &str, ticket: &Ticket, served: bool, completion: Option<u64>) {
        let Some(prompt) = ticket.taken_tokens else {
            return;
        };
        let q = ticket.quota;
        let (requests, tokens) = if served {
            (0.0, -(completion.unwrap_or(0) as f64))
        } else {
            (1.0, prompt as f64)
        };
        let requests = if q.requests_per_minute.is_some() {
            requests
        } else {
            0.0
        };
        let tokens = if q.tokens_per_minute.is_some() {
            tokens
        } else {
            0.0
        };
        if requests == 0.0 && tokens == 0.0 {
            return;
        }
        let charge = Charge {
            tenant: tenant.to_string(),
            quota: q,
            requests,
            tokens,
        };
        let shared = self.redis.as_ref().is_some_and(|r| r.reachable());
        match &self.charges {
            Some(tx) if shared => {
                if let Err(e) = tx.send(charge) {
                    self.local.charge(tenant, &q, e.0.requests, e.0.tokens);
                }
            }
            _ => self.local.charge(tenant, &q, requests, tokens),
        }
    }

    /// `/status`: where budgets live, and each budgeted tenant's buckets (the first
    /// `metrics.max_tenants`, like the tenant label set).
    pub fn status(&self) -> QuotaStatus {
        let budgets = self.budgets.load();
        let max = self.max_listed.load(Ordering::Relaxed);
        let tenants = budgets
            .iter()
            .take(max)
            .map(|(tenant, q)| {
                let v = self.local.peek(tenant, q);
                let buckets = v
                    .dims()
                    .map(|(name, d)| {
                        let bucket = BucketStatus {
                            limit_per_minute: d.limit,
                            remaining: d.remaining(),
                            level: (d.level * 1000.0).round() / 1000.0,
                            full_in: openai_duration(d.full_in_ms()),
                        };
                        (name, bucket)
                    })
                    .collect();
                TenantBudget {
                    tenant: tenant.clone(),
                    over_budget: !v.room,
                    buckets,
                }
            })
            .collect();
        let shared = self.redis.as_ref().map(|r| {
            let refreshed = *self
                .refreshed_at
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            SharedBudgets {
                reachable: r.reachable(),
                // Unreachable: each replica enforces budgets on its own buckets. Without any
                // budget Redis is never asked, so nothing fails open.
                fail_open: !r.reachable() && !budgets.is_empty(),
                fail_open_total: self.fail_open_total.load(Ordering::Relaxed),
                last_error: r.last_error(),
                refreshed_ms_ago: refreshed.map(|t| t.elapsed().as_millis() as u64),
            }
        });
        QuotaStatus {
            store: if self.redis.is_some() {
                "redis"
            } else {
                "local"
            },
            tenants_with_budget: budgets.len(),
            tenants,
            shared,
        }
    }

    /// With Redis: the charge batcher and the refresh loop; runs until its runtime ends.
    pub async fn run_background(&self) {
        let Some(r) = &self.redis else {
            return;
        };
        let rx = self
            .charges_rx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let local = Arc::clone(&self.local);
        let batcher = async move {
            if let Some(rx) = rx {
                charge_batches(Arc::downgrade(r), rx, |c: &Charge| {
                    local.charge(&c.tenant, &c.quota, c.requests, c.tokens)
                })
                .await
            }
        };
        tokio::join!(batcher, self.refresh_loop(r));
    }

    /// Connects, probes and copies the listed tenants' shared buckets into the local ones
    /// every 250 ms. Without any budget configured it leaves Redis alone.
    async fn refresh_loop(&self, r: &RedisQuota) {
        let mut tick = tokio::time::interval(REFRESH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0u32;
        loop {
            tick.tick().await;
            let budgets = self.budgets.load_full();
            if budgets.is_empty() {
                continue;
            }
            if !r.connected() || failures >= RECONNECT_AFTER_FAILURES {
                failures = 0;
                if r.connect().await.is_err() {
                    continue;
                }
            }
            let max = self.max_listed.load(Ordering::Relaxed).min(budgets.len());
            match r.peek(&budgets[..max]).await {
                Ok(verdicts) => {
                    failures = 0;
                    for ((tenant, q), v) in budgets.iter().zip(&verdicts) {
                        self.local.mirror(tenant, q, v);
                    }
                    *self
                        .refreshed_at
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                }
                Err(_) => failures += 1,
            }
        }
    }
}

struct Background(Arc<Quotas>);

#[async_trait]
impl BackgroundService for Background {
    async fn start(&self, _shutdown: ShutdownWatch) {
        // Charges of streams still draining at shutdown must still leave, so this runs until
        // the runtime itself is dropped.
        self.0.run_background().await
    }
}

/// Token budgets in `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct QuotaStatus {
    /// `redis` when budgets are shared between replicas, else `local`.
    pub store: &'static str,
    pub tenants_with_budget: usize,
    pub tenants: Vec<TenantBudget>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedBudgets>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantBudget {
    pub tenant: String,
    pub over_budget: bool,
    /// Keyed by dimension (`requests`, `tokens`).
    #[serde(flatten)]
    pub buckets: std::collections::BTreeMap<&'static str, BucketStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BucketStatus {
    pub limit_per_minute: u64,
    pub remaining: u64,
    pub level: f64,
    pub full_in: String,
}

/// The shared store's side of budgets.
#[derive(Debug, Clone, Serialize)]
pub struct SharedBudgets {
    pub reachable: bool,
    pub fail_open: bool,
    pub fail_open_total: u64,
    pub last_error: Option<String>,
    pub refreshed_ms_ago: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(rpm: Option<u64>, tpm: Option<u64>) -> QuotaConfig {
        QuotaConfig {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    #[tokio::test]
    async fn over_budget_demotes_one_tier_and_best_effort_is_refused() {
        let qs = Quotas::local();
        let quota = q(Some(1), None);
        let t = qs.admit("g", quota, Tier::Guaranteed, Some(10)).await;
        assert!(!t.demoted() && !t.refused);
        assert_eq!(t.taken_tokens, Some(10));
        let t = qs.admit("g", quota, Tier::Guaranteed, Some(10)).await;
        assert_eq!((t.served, t.refused), (Tier::Standard, false));
        assert_eq!(t.taken_tokens, None, "a demoted request is not charged");
        let t = qs.admit("g", quota, Tier::Guaranteed, None).await;
        assert!(!t.demoted(), "reads are never demoted");
        assert!(!t.headers().is_empty());

        let t = qs.admit("b", quota, Tier::BestEffort, Some(0)).await;
        assert!(!t.refused);
        let t = qs.admit("b", quota, Tier::BestEffort, Some(0)).await;
        assert!(t.refused);
        assert_eq!(t.served, Tier::BestEffort);
    }

    #[tokio::test]
    async fn settle_charges_completions_and_refunds_refusals() {
        let qs = Quotas::local();
        let quota = q(Some(2), Some(1000));
        let t = qs.admit("a", quota, Tier::Standard, Some(100)).await;
        qs.settle("a", &t, true, Some(5000));
        let t = qs.admit("a", quota, Tier::Standard, Some(100)).await;
        assert!(t.demoted(), "the completion left a debt");
        assert!(t.verdict.tokens.unwrap().level < -4000.0);
        qs.settle("a", &t, true, Some(5000));
        assert!(
            qs.local.peek("a", &quota).tokens.unwrap().level > -4200.0,
            "not charged"
        );

        let t = qs.admit("r", quota, Tier::Standard, Some(100)).await;
        qs.settle("r", &t, false, None);
        let v = qs.local.peek("r", &quota);
        assert_eq!(v.requests.unwrap().level, 2.0, "refunded");
        assert_eq!(v.tokens.unwrap().level, 1000.0);
    }

    #[test]
    fn status_lists_budgeted_tenants_up_to_the_label_cap() {
        let mut cfg = Config::default();
        for i in 0..5 {
            let mut e = sluice_config::TenantEntry::of_tier("Standard");
            e.quota = Some(q(Some(10), None));
            cfg.tenants.insert(format!("t{i}"), e);
        }
        cfg.tenants.insert("free".into(), "Standard".into());
        cfg.metrics.max_tenants = 3;
        let qs = Quotas::local();
        qs.configure(&cfg);
        let s = serde_json::to_value(qs.status()).unwrap();
        assert_eq!(s["store"], "local");
        assert_eq!(s["tenants_with_budget"], 5);
        assert_eq!(s["tenants"].as_array().unwrap().len(), 3);
        assert_eq!(s["tenants"][0]["requests"]["remaining"], 10);
        assert!(s["tenants"][0].get("tokens").is_none());
    }
}
