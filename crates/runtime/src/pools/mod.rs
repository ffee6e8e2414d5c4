//! Backend pools: one Pingora `LoadBalancer` per configured pool, each health-checked by its own
//! background service ([`health`]); the models each serves, declared or discovered
//! ([`discovery`]), published as the routing table; and the replica a request goes to
//! ([`select`]).

mod discovery;
mod health;
mod select;

pub use discovery::ModelDiscovery;
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
use sluice_config::{Config, PoolClass, Selection};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
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
    /// Where prompt heads live, kept across health changes.
    homes: select::Homes,
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
                homes: select::Homes::default(),
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

    /// A usable backend of `h` for the request `want` describes.
    pub fn select(&self, h: &PoolHandle, want: Want<'_>) -> Option<(Backend, BackendInfo)> {
        self.with_usable(h, |set| {
            set.pick(h.selection, h.load_bound, h.index, want, &h.homes)
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

    /// Runs `f` on `h`'s usable backends, recomputed when the registry's generation moved.
    /// A flip during the computation bumps the generation after storing the new health, so a
    /// set computed under the older generation is recomputed by the next caller.
    fn with_usable<T>(&self, h: &PoolHandle, f: impl FnOnce(&UsableSet) -> T) -> T {
        let generation = self.registry.generation.load(Ordering::Acquire);
        let cached = h.usable.load();
        if let Some(set) = cached.as_deref().filter(|s| s.generation == generation) {
            return f(set);
        }
        let backends = h
            .balancer
            .backends()
            .get_backend()
            .iter()
            .filter(|b| self.usable(h, b))
            .filter_map(|b| Some((b.clone(), h.info(b)?)))
            .collect();
        let set = Arc::new(UsableSet::new(generation, backends));
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
        PoolStatus {
            name: h.name.clone(),
            class: h.class.as_str(),
            selection: h.selection.as_str(),
            vllm_priority: h.vllm_priority,
            healthy_backends: backends.iter().filter(|b| b.healthy).count(),
            models: pool_models,
            backends,
        }
    }
}
