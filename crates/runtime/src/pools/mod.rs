//! Backend pools: one Pingora `LoadBalancer` per configured pool, each health-checked by its own
//! background service ([`health`]); the models each serves, declared or discovered
//! ([`discovery`]), published as the routing table; the replica a request goes to
//! ([`select`]); and what a request that failed before its first byte may do next: the replicas
//! passively ejected for failing ([`eject`]) and each pool's retry budget ([`budget`]).

mod affinity;
mod budget;
mod discovery;
mod eject;
mod health;
mod select;

pub use affinity::{cached_tokens, AffinityStatus, AffinityTicket};
pub use budget::{BudgetCheck, RetryBudget};
pub use discovery::ModelDiscovery;
pub use eject::{
    ejection_time, may_eject, times_when_ejected, Ejected, EjectionStatus, FailureCause, Passive,
};
pub use health::HealthRegistry;
pub use select::Want;

use crate::backend_tls::{BackendTls, UpstreamTls};
use crate::fleet::{BackendLoad, BackendLoads, Discovered, Fleet, Routes};
use arc_swap::{ArcSwap, ArcSwapOption};
use health::{balancer, BackendKey};
use pingora::lb::{Backend, LoadBalancer};
use pingora::prelude::RoundRobin;
use pingora::services::background::{background_service, GenBackgroundService};
use select::UsableSet;
use serde::Serialize;
use sluice_config::{Config, EjectionConfig, PoolClass, Selection};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pingora's balancer keeps each pool's backends and runs their health checks; the pick itself
/// is [`select`]'s.
pub type Balancer = LoadBalancer<RoundRobin>;

/// What a request needs of its backend beyond the address, set once when the pool is built.
/// Kept beside the balancer, not in `Backend::ext`: the balancer clones the backend it picks,
/// and with it every extension (a map and a box per value, per request).
#[derive(Clone)]
pub struct BackendInfo {
    /// The address as text: every record names its backend, and formatting a socket address
    /// per request is a visible share of its cost.
    pub name: Arc<str>,
    pub tls: Option<Arc<UpstreamTls>>,
    pub load: Arc<BackendLoad>,
    /// Its failures in a row and ejection, in this pool.
    pub passive: Arc<Passive>,
}

/// The [`BackendInfo`] of each backend of one pool, by address.
pub type BackendInfos = HashMap<std::net::SocketAddr, BackendInfo>;

/// One pool: its balancer, its place in the fleet and how it picks a replica.
pub struct PoolHandle {
    pub name: String,
    /// The name, leaked once: metrics labels, records and headers borrow it per request.
    pub label: &'static str,
    /// Its index in the fleet (the policy's and the routing table's pool index).
    pub index: usize,
    pub class: PoolClass,
    pub selection: Selection,
    pub load_bound: f64,
    pub vllm_priority: bool,
    pub balancer: Arc<Balancer>,
    infos: Arc<BackendInfos>,
    /// The usable backends as of one registry generation, which every request picks from and
    /// asks about. Asking the balancer instead (`select_with`: its health map and the health
    /// rule's lookup, each hashing the backend, a set of the backends tried, then the
    /// backend's info by address) was ~2k instructions a request, the largest part of
    /// `upstream_peer`.
    usable: ArcSwapOption<UsableSet>,
    /// Where prompt heads live, kept across health changes, and whether sending them there pays.
    affinity: Arc<affinity::Affinity>,
    /// `pools.<name>.retries`: times a request first sent here may be sent again.
    pub retries: u32,
    pub ejection: EjectionConfig,
    /// Retries of requests first sent here, against those requests.
    pub budget: RetryBudget,
    pub stats: PoolStats,
    /// Held while deciding an ejection, so two replicas failing at once cannot both take the
    /// last place the pool's share allows.
    eject_lock: std::sync::Mutex<()>,
}

/// Why a request that failed before its first byte was not sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDenied {
    /// The pool's retry budget is spent for now.
    Budget,
    /// The request had its `retries` already.
    Limit,
    /// No replica it has not tried is usable.
    NoReplica,
}

impl RetryDenied {
    pub const ALL: [RetryDenied; 3] = [
        RetryDenied::Budget,
        RetryDenied::Limit,
        RetryDenied::NoReplica,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RetryDenied::Budget => "budget",
            RetryDenied::Limit => "limit",
            RetryDenied::NoReplica => "no_replica",
        }
    }
}

/// A pool's retry and ejection counts since start, by cause (`/status`, mirrored to `/metrics`).
#[derive(Debug, Default)]
pub struct PoolStats {
    retries: [AtomicU64; 3],
    denied: [AtomicU64; 3],
    ejections: [AtomicU64; 3],
}

impl PoolStats {
    pub fn retried(&self, cause: FailureCause) {
        self.retries[cause.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn denied(&self, why: RetryDenied) {
        self.denied[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn retries(&self, cause: FailureCause) -> u64 {
        self.retries[cause.index()].load(Ordering::Relaxed)
    }

    pub fn denials(&self, why: RetryDenied) -> u64 {
        self.denied[why as usize].load(Ordering::Relaxed)
    }

    pub fn ejections(&self, cause: FailureCause) -> u64 {
        self.ejections[cause.index()].load(Ordering::Relaxed)
    }

    fn by_cause(counts: &[AtomicU64; 3]) -> std::collections::BTreeMap<&'static str, u64> {
        FailureCause::ALL
            .iter()
            .map(|c| (c.as_str(), counts[c.index()].load(Ordering::Relaxed)))
            .collect()
    }
}

impl PoolHandle {
    /// The name, TLS settings and load of one of this pool's backends.
    fn info(&self, b: &Backend) -> Option<BackendInfo> {
        b.addr.as_inet().and_then(|a| self.infos.get(a)).cloned()
    }

    /// The backends as the balancer holds them, by name.
    pub fn backend_names(&self) -> Vec<String> {
        self.infos.values().map(|i| i.name.to_string()).collect()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BackendStatus {
    pub backend: String,
    pub healthy: bool,
    pub checked: bool,
    pub last_error: Option<String>,
    pub last_check_ms_ago: Option<u64>,
    /// Requests Sluice has there now.
    pub inflight: u32,
    /// Share of the pool's requests sent there since start (0–1).
    pub share: f64,
    /// KV-cache usage (0–1) and vLLM's waiting requests from the last fresh scrape.
    pub kv_usage: Option<f64>,
    pub waiting: Option<u32>,
    /// The models it serves, once known.
    pub models: Option<Vec<String>>,
    /// Its prefix-cache hit rate in tokens, as the pool's (`prefix_cache_hit_rate`).
    pub prefix_cache_hit_rate: Option<f64>,
    /// Its failed attempts in a row (connect, reset, 5xx).
    pub consecutive_failures: u32,
    /// Out of selection for failing, and until when; `null` when not.
    pub ejected: Option<EjectionStatus>,
}

/// A pool's retry budget now.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetStatus {
    pub ratio: f64,
    pub window_ms: u64,
    /// Requests first sent to the pool, and their retries, in the window.
    pub requests: u64,
    pub retries: u64,
    /// Retries the window allows.
    pub limit: u64,
}

/// An ejection ended (its time was up): logged once.
fn returned(h: &PoolHandle, info: &BackendInfo) {
    log::warn!(
        "{}",
        serde_json::json!({"event": "backend_returned", "pool": h.name, "backend": &*info.name,
                           "why": "ejection_ended"})
    );
}

#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    pub name: String,
    pub class: &'static str,
    pub selection: &'static str,
    pub vllm_priority: bool,
    pub healthy_backends: usize,
    /// Declared or discovered; empty while unknown.
    pub models: Vec<String>,
    /// Backends out of selection for failing (not counted in `healthy_backends`).
    pub ejected_backends: usize,
    /// `pools.<name>.retries`.
    pub max_retries: u32,
    pub retry_budget: BudgetStatus,
    /// Since start, by cause (`connect`, `reset`, `5xx`): retries of requests that failed here,
    /// and ejections of its replicas.
    pub retries: std::collections::BTreeMap<&'static str, u64>,
    pub ejections: std::collections::BTreeMap<&'static str, u64>,
    /// Failures not retried, by why: `budget`, `limit`, `no_replica`.
    pub retries_denied: std::collections::BTreeMap<&'static str, u64>,
    /// Prompt tokens the pool's replicas served from their prefix caches over those they were
    /// asked, over the last half minute or so (vLLM's `prefix_cache_hits` and `_queries`
    /// counters, scraped); `null` until two scrapes have counted some.
    pub prefix_cache_hit_rate: Option<f64>,
    /// With `prefix_affinity`: whether homes keep their heads, and so whether they are used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<AffinityStatus>,
    pub backends: Vec<BackendStatus>,
}

pub struct PoolSet {
    pools: Vec<PoolHandle>,
    registry: Arc<HealthRegistry>,
    /// Set once every backend has been checked at least once (fast path of `first_checks`).
    all_checked: std::sync::atomic::AtomicBool,
    fleet: Fleet,
    routes: ArcSwap<Routes>,
    /// What each backend last answered on `/v1/models`, kept across failed asks.
    discovered: std::sync::Mutex<(Discovered, u64)>,
    loads: Arc<BackendLoads>,
}

impl PoolSet {
    /// Builds the balancers and returns the background services that health-check them; the
    /// caller registers those with the server.
    pub fn build(
        cfg: &Config,
        tls: &BackendTls,
    ) -> std::io::Result<(Arc<PoolSet>, Vec<GenBackgroundService<Balancer>>)> {
        let registry = Arc::new(HealthRegistry::default());
        let mut loads = BackendLoads::default();
        let mut services = Vec::new();
        let mut pools = Vec::new();
        for (index, p) in cfg.pools.iter().enumerate() {
            let c = &p.config;
            let (lb, infos) = balancer(&c.backends, &c.health_check, &registry, tls, &mut loads)?;
            let budget = RetryBudget::new(&cfg.routing.retry_budget);
            let svc = background_service(&format!("health check {}", p.name), lb);
            pools.push(PoolHandle {
                name: p.name.clone(),
                label: Box::leak(p.name.clone().into_boxed_str()),
                index,
                class: p.class(),
                selection: c.selection,
                load_bound: c.load_bound,
                vllm_priority: c.vllm_priority,
                balancer: svc.task(),
                infos,
                usable: ArcSwapOption::empty(),
                affinity: Arc::default(),
                retries: c.retries,
                ejection: c.ejection.clone(),
                budget,
                stats: PoolStats::default(),
                eject_lock: Default::default(),
            });
            services.push(svc);
        }
        let backends = pools.iter().map(PoolHandle::backend_names).collect();
        let fleet = Fleet::from_config(cfg, backends);
        let routes = Routes::build(&fleet, &Discovered::new(), 0);
        let set = PoolSet {
            pools,
            registry,
            all_checked: Default::default(),
            fleet,
            routes: ArcSwap::from_pointee(routes),
            discovered: Default::default(),
            loads: Arc::new(loads),
        };
        let distinct: std::collections::HashSet<BackendKey> = set
            .all()
            .flat_map(|h| {
                h.balancer
                    .backends()
                    .get_backend()
                    .iter()
                    .map(BackendKey::of)
                    .collect::<Vec<_>>()
            })
            .collect();
        let _ = set.registry.expected.set(distinct.len());
        Ok((Arc::new(set), services))
    }

    /// Every backend's load, shared with the scraper, which records what `/metrics` says.
    pub fn loads(&self) -> Arc<BackendLoads> {
        Arc::clone(&self.loads)
    }

    /// The routing table now (the policy's copy may be one sample behind).
    pub fn routes(&self) -> Arc<Routes> {
        self.routes.load_full()
    }

    /// Records what a backend answered on `/v1/models`; rebuilds and returns the table when
    /// that changed what anyone serves.
    fn record_models(&self, answers: Vec<(String, Vec<serde_json::Value>)>) -> Option<Arc<Routes>> {
        let mut guard = self.discovered.lock().unwrap_or_else(|e| e.into_inner());
        let (discovered, generation) = &mut *guard;
        let mut changed = false;
        for (backend, entries) in answers {
            if discovered.get(&backend) != Some(&entries) {
                discovered.insert(backend, entries);
                changed = true;
            }
        }
        if !changed {
            return None;
        }
        *generation += 1;
        let routes = Arc::new(Routes::build(&self.fleet, discovered, *generation));
        self.routes.store(Arc::clone(&routes));
        Some(routes)
    }

    /// Waits (at most `limit`) for every backend's first health check. Requests arriving in the
    /// first milliseconds of a process — right after a binary upgrade, say — would otherwise
    /// find no backend checked yet and get a 503.
    pub async fn first_checks(&self, limit: Duration) {
        if self.all_checked.load(Ordering::Relaxed) {
            return;
        }
        let deadline = Instant::now() + limit;
        loop {
            let done = self.all().all(|h| {
                h.balancer
                    .backends()
                    .get_backend()
                    .iter()
                    .all(|b| self.registry.get(b).last_check.is_some())
            });
            if done {
                self.all_checked.store(true, Ordering::Relaxed);
                return;
            }
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn usable(&self, h: &PoolHandle, b: &Backend) -> bool {
        h.balancer.backends().ready(b) && self.registry.passed_once(b)
    }

    /// A usable backend of `h` for the request `want` describes; with prefix affinity, a ticket
    /// when it is the head's home, for the answer to say whether the home kept the head.
    pub fn select(
        &self,
        h: &PoolHandle,
        want: Want<'_>,
    ) -> Option<(Backend, BackendInfo, Option<AffinityTicket>)> {
        self.with_usable(h, |set| {
            set.pick(h.selection, h.load_bound, h.index, want, &h.affinity)
        })
    }

    pub fn healthy_count(&self, h: &PoolHandle) -> usize {
        self.with_usable(h, |set| set.backends.len())
    }

    pub fn any_usable(&self, h: &PoolHandle) -> bool {
        self.with_usable(h, |set| !set.backends.is_empty())
    }

    /// Whether `h` has a usable backend that serves `model` by `routes`.
    pub fn any_usable_for(&self, h: &PoolHandle, routes: &Routes, model: Option<&str>) -> bool {
        let models = routes.pools.get(h.index);
        self.with_usable(h, |set| match models {
            Some(m) if !m.uniform => set.backends.iter().any(|(_, i)| m.serves(&i.name, model)),
            _ => !set.backends.is_empty(),
        })
    }

    /// Whether `h` has a usable backend serving `model` that is none of `tried`.
    pub fn has_untried(
        &self,
        h: &PoolHandle,
        routes: &Routes,
        model: Option<&str>,
        tried: &[Arc<str>],
    ) -> bool {
        let models = routes.pools.get(h.index).filter(|m| !m.uniform);
        self.with_usable(h, |set| {
            set.backends.iter().any(|(_, i)| {
                models.is_none_or(|m| m.serves(&i.name, model)) && !tried.contains(&i.name)
            })
        })
    }

    /// A failed attempt on a backend of `h` (its [`Passive`]): `Some` when that run of failures
    /// ejected it. Ejection takes it out of every request's choice at once.
    pub fn failed(
        &self,
        h: &PoolHandle,
        backend: &str,
        passive: &Passive,
        cause: FailureCause,
    ) -> Option<Ejected> {
        if !passive.failed(h.ejection.consecutive_failures) {
            return None;
        }
        let _one_at_a_time = h.eject_lock.lock().unwrap_or_else(|e| e.into_inner());
        if passive.is_ejected() {
            return None;
        }
        let now = Instant::now();
        let out = h
            .infos
            .values()
            .filter(|i| i.passive.is_ejected() && i.passive.until().is_some_and(|u| u > now))
            .count();
        if !may_eject(out, h.infos.len(), h.ejection.max_ejected_percent) {
            return None;
        }
        let e = passive.eject(&h.ejection, cause, now);
        h.stats.ejections[cause.index()].fetch_add(1, Ordering::Relaxed);
        self.registry.generation.fetch_add(1, Ordering::Release);
        log::warn!(
            "{}",
            serde_json::json!({"event": "backend_ejected", "pool": h.name, "backend": backend,
                               "cause": cause.as_str(), "for_ms": e.duration.as_millis() as u64,
                               "times": e.times})
        );
        Some(e)
    }

    /// Runs `f` on `h`'s usable backends, recomputed when the registry's generation moved.
    /// A flip during the computation bumps the generation after storing the new health, so a
    /// set computed under the older generation is recomputed by the next caller.
    /// An ejected backend is left out until its ejection ends: a set holding one is recomputed
    /// once the earliest ejection's time is up (the clock is read only while one is ejected).
    fn with_usable<T>(&self, h: &PoolHandle, f: impl FnOnce(&UsableSet) -> T) -> T {
        let generation = self.registry.generation.load(Ordering::Acquire);
        let cached = h.usable.load();
        if let Some(set) = cached
            .as_deref()
            .filter(|s| s.generation == generation && s.expires.is_none_or(|t| Instant::now() < t))
        {
            return f(set);
        }
        let now = Instant::now();
        let mut expires: Option<Instant> = None;
        let backends = h
            .balancer
            .backends()
            .get_backend()
            .iter()
            .filter(|b| self.usable(h, b))
            .filter_map(|b| Some((b.clone(), h.info(b)?)))
            .filter(|(_, info)| {
                if info.passive.expire(now) {
                    returned(h, info);
                }
                match info.passive.until() {
                    Some(until) => {
                        expires = Some(expires.map_or(until, |e| e.min(until)));
                        false
                    }
                    None => true,
                }
            })
            .collect();
        let mut set = UsableSet::new(generation, backends);
        set.expires = expires;
        let set = Arc::new(set);
        h.usable.store(Some(Arc::clone(&set)));
        f(&set)
    }

    pub fn get(&self, index: usize) -> Option<&PoolHandle> {
        self.pools.get(index)
    }

    pub fn by_name(&self, name: &str) -> Option<&PoolHandle> {
        self.pools.iter().find(|h| h.name == name)
    }

    pub fn all(&self) -> impl Iterator<Item = &PoolHandle> {
        self.pools.iter()
    }

    pub fn len(&self) -> usize {
        self.pools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    pub fn status(&self, h: &PoolHandle) -> PoolStatus {
        let routes = self.routes();
        let models = routes.pools.get(h.index);
        let total: u64 = h.infos.values().map(|i| i.load.picks()).sum();
        let now = Instant::now();
        let backends: Vec<BackendStatus> = h
            .balancer
            .backends()
            .get_backend()
            .iter()
            .filter_map(|b| {
                let info = h.info(b)?;
                let r = self.registry.get(b);
                let load = &info.load;
                Some(BackendStatus {
                    consecutive_failures: info.passive.failures(),
                    ejected: info.passive.status(now),
                    healthy: self.usable(h, b),
                    checked: r.last_check.is_some(),
                    last_error: r.last_error,
                    last_check_ms_ago: r.last_check.map(|t| t.elapsed().as_millis() as u64),
                    inflight: load.inflight(),
                    share: if total == 0 {
                        0.0
                    } else {
                        load.picks() as f64 / total as f64
                    },
                    kv_usage: load.kv_usage(),
                    waiting: load.waiting(),
                    prefix_cache_hit_rate: load.prefix_cache().rate(),
                    models: models.and_then(|m| m.models_of(&info.name)),
                    backend: info.name.to_string(),
                })
            })
            .collect();
        let mut pool_models: Vec<String> = backends
            .iter()
            .flat_map(|b| b.models.iter().flatten().cloned())
            .collect();
        pool_models.sort();
        pool_models.dedup();
        let window = h.budget.window(now);
        let cache = h
            .infos
            .values()
            .map(|i| i.load.prefix_cache())
            .fold(crate::fleet::PrefixCache::default(), |a, b| a + b);
        PoolStatus {
            name: h.name.clone(),
            class: h.class.as_str(),
            selection: h.selection.as_str(),
            vllm_priority: h.vllm_priority,
            healthy_backends: backends
                .iter()
                .filter(|b| b.healthy && b.ejected.is_none())
                .count(),
            models: pool_models,
            ejected_backends: backends.iter().filter(|b| b.ejected.is_some()).count(),
            max_retries: h.retries,
            retry_budget: BudgetStatus {
                ratio: h.budget.ratio(),
                window_ms: h.budget.window_ms(),
                requests: window.requests,
                retries: window.retries,
                limit: window.limit,
            },
            retries: PoolStats::by_cause(&h.stats.retries),
            ejections: PoolStats::by_cause(&h.stats.ejections),
            retries_denied: RetryDenied::ALL
                .iter()
                .map(|w| (w.as_str(), h.stats.denials(*w)))
                .collect(),
            prefix_cache_hit_rate: cache.rate(),
            affinity: (h.selection == Selection::PrefixAffinity).then(|| h.affinity.status()),
            backends,
        }
    }
}
