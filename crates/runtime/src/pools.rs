//! Backend pools: one Pingora `LoadBalancer` per pool (on-demand, spot, and one per fallback
//! target), each health-checked by its own background service.
//!
//! Health rule: a backend is usable only once a health check has *passed* since start and
//! Pingora still counts it healthy. Pingora starts every backend healthy; we do not, so a dead
//! backend is never picked in the window before its first check.

use crate::backend_tls::{BackendTls, UpstreamTls};
use arc_swap::ArcSwapOption;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora::lb::health_check::{HealthCheck, HttpHealthCheck};
use pingora::lb::{Backend, LoadBalancer};
use pingora::prelude::RoundRobin;
use pingora::services::background::{background_service, GenBackgroundService};
use serde::Serialize;
use sluice_config::{backend_of_url, Config, HealthCheckConfig, PoolConfig};
use sluice_policy::Pool;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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
}

/// The [`BackendInfo`] of each backend of one pool, by address.
pub type BackendInfos = HashMap<std::net::SocketAddr, BackendInfo>;

#[derive(Debug, Clone, Default)]
struct CheckRecord {
    passed_once: bool,
    last_ok: bool,
    last_error: Option<String>,
    last_check: Option<Instant>,
}

/// What the health checks have seen, keyed by backend address. Read on every request (the health
/// rule), written once per check: a read-write lock over a map keyed by the address itself, so a
/// lookup neither allocates nor contends with other requests.
#[derive(Debug, Default)]
pub struct HealthRegistry {
    records: RwLock<HashMap<BackendKey, CheckRecord>>,
    /// How many distinct backends the pool set has, known once it is built.
    expected: std::sync::OnceLock<usize>,
    /// Every backend has passed a check: `passed_once` never goes back, so from then on a
    /// request answers it without the lock, whose shared counter both workers' cores would
    /// otherwise pull back and forth several times a request.
    all_passed: std::sync::atomic::AtomicBool,
    /// Bumped after anything that can change whether a backend is usable: a backend's first
    /// pass, and every flip of Pingora's health (reported after the flip is stored). The
    /// pools' cached answers are valid for one value of it.
    generation: AtomicU64,
}

/// Backends are TCP addresses; `Display` only for the rare other kind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum BackendKey {
    Inet(std::net::SocketAddr),
    Other(String),
}

impl BackendKey {
    fn of(b: &Backend) -> Self {
        match b.addr.as_inet() {
            Some(a) => BackendKey::Inet(*a),
            None => BackendKey::Other(b.addr.to_string()),
        }
    }
}

impl HealthRegistry {
    fn record(&self, key: BackendKey, result: &pingora::Result<()>) {
        let mut map = self.records.write().unwrap_or_else(|e| e.into_inner());
        let r = map.entry(key).or_default();
        r.last_ok = result.is_ok();
        let first_pass = r.last_ok && !r.passed_once;
        r.passed_once |= r.last_ok;
        if first_pass {
            self.generation.fetch_add(1, Ordering::Release);
        }
        r.last_error = result.as_ref().err().map(|e| e.to_string());
        r.last_check = Some(Instant::now());
        if r.passed_once && !self.all_passed.load(Ordering::Relaxed) {
            let passed = map.values().filter(|r| r.passed_once).count();
            if self.expected.get().is_some_and(|&n| passed >= n) {
                self.all_passed.store(true, Ordering::Release);
            }
        }
    }

    fn get(&self, b: &Backend) -> CheckRecord {
        let map = self.records.read().unwrap_or_else(|e| e.into_inner());
        map.get(&BackendKey::of(b)).cloned().unwrap_or_default()
    }

    fn passed_once(&self, b: &Backend) -> bool {
        if self.all_passed.load(Ordering::Acquire) {
            return true;
        }
        let map = self.records.read().unwrap_or_else(|e| e.into_inner());
        map.get(&BackendKey::of(b)).is_some_and(|r| r.passed_once)
    }
}

/// Wraps Pingora's HTTP check to record every result for the health rule and `/status`.
struct RecordingCheck {
    /// One check per server name: Pingora's check takes its TLS settings from one peer
    /// template, and each TLS backend may have its own SNI. Plain backends use the key "".
    checks: HashMap<String, HttpHealthCheck>,
    infos: Arc<BackendInfos>,
    config: HealthCheckConfig,
    registry: Arc<HealthRegistry>,
}

#[async_trait]
impl HealthCheck for RecordingCheck {
    async fn check(&self, target: &Backend) -> pingora::Result<()> {
        let sni = target
            .addr
            .as_inet()
            .and_then(|a| self.infos.get(a))
            .and_then(|i| i.tls.as_deref())
            .map_or("", |t| t.sni.as_str());
        let result = match self.checks.get(sni) {
            Some(check) => check.check(target).await,
            None => pingora::Error::e_explain(
                pingora::ErrorType::InternalError,
                "no health check built for this backend",
            ),
        };
        self.registry.record(BackendKey::of(target), &result);
        result
    }

    async fn health_status_change(&self, target: &Backend, healthy: bool) {
        self.registry.generation.fetch_add(1, Ordering::Release);
        // The reason travels with the change, so a TLS or connect failure is readable in the
        // log without polling /status.
        let error = self.registry.get(target).last_error.filter(|_| !healthy);
        log::warn!(
            "{}",
            serde_json::json!({"event": "backend_health", "backend": target.addr.to_string(), "healthy": healthy, "error": error})
        );
    }

    fn health_threshold(&self, success: bool) -> usize {
        if success {
            self.config.consecutive_success
        } else {
            self.config.consecutive_failure
        }
    }
}

/// One pool: its balancer and the names needed to report it.
pub struct PoolHandle {
    pub name: String,
    pub pool: Pool,
    pub balancer: Arc<Balancer>,
    /// The fallback model served here (fallback pools only).
    pub model: Option<String>,
    /// A fallback served by a backend of the on-demand or spot pool runs on that pool's
    /// capacity: its traffic counts there, and adaptive mode sends none to a saturated pool.
    pub runs_on: Option<Pool>,
    infos: Arc<BackendInfos>,
    /// The usable backends as of one registry generation, which every request picks from and
    /// asks about (the spot and fallback pools' `any_usable`). Asking the balancer instead
    /// (`select_with`: its health map and the health rule's lookup, each hashing the backend, a
    /// set of the backends tried, then the backend's info by address) was ~2k instructions a
    /// request, the largest part of `upstream_peer` (bench/RESULTS.md, "Overhead at 47a41a1 on an
    /// Intel host").
    usable: ArcSwapOption<UsableSet>,
    /// This pool's place in the set, which keys each thread's round-robin counter.
    ordinal: usize,
}

/// A pool's usable backends, in the balancer's order, each with its [`BackendInfo`].
struct UsableSet {
    generation: u64,
    backends: Box<[(Backend, BackendInfo)]>,
}

impl UsableSet {
    /// Round robin from this thread's counter for pool `ordinal` (each worker rotates on its
    /// own, which spreads requests as evenly as one shared counter without both cores writing
    /// it; one counter per pool, so picks alternating between pools still rotate in each),
    /// skipping `exclude` while another backend is usable.
    fn pick(&self, ordinal: usize, exclude: Option<&str>) -> Option<(Backend, BackendInfo)> {
        thread_local! {
            static NEXT: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
        }
        let n = self.backends.len();
        if n == 0 {
            return None;
        }
        let start = NEXT.with_borrow_mut(|next| {
            if next.len() <= ordinal {
                next.resize(ordinal + 1, 0);
            }
            let v = next[ordinal];
            next[ordinal] = v.wrapping_add(1);
            v
        });
        let at = |i: usize| &self.backends[(start + i) % n];
        let chosen = (0..n)
            .map(at)
            .find(|(_, info)| exclude.is_none_or(|x| *info.name != *x))
            .unwrap_or_else(|| at(0));
        Some(chosen.clone())
    }
}

impl PoolHandle {
    /// The name and TLS settings of one of this pool's backends.
    fn info(&self, b: &Backend) -> BackendInfo {
        b.addr
            .as_inet()
            .and_then(|a| self.infos.get(a))
            .cloned()
            .unwrap_or_else(|| BackendInfo {
                name: b.addr.to_string().into(),
                tls: None,
            })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BackendStatus {
    pub backend: String,
    pub healthy: bool,
    pub checked: bool,
    pub last_error: Option<String>,
    pub last_check_ms_ago: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    pub name: String,
    pub healthy_backends: usize,
    pub backends: Vec<BackendStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

pub struct PoolSet {
    pub on_demand: PoolHandle,
    pub spot: PoolHandle,
    /// In priority order: the first with a healthy backend serves fallback traffic.
    pub fallbacks: Vec<PoolHandle>,
    registry: Arc<HealthRegistry>,
    /// Set once every backend has been checked at least once (fast path of `first_checks`).
    all_checked: std::sync::atomic::AtomicBool,
}

impl PoolSet {
    /// Builds the balancers and returns the background services that health-check them; the
    /// caller registers those with the server.
    pub fn build(
        cfg: &Config,
        tls: &BackendTls,
    ) -> std::io::Result<(Arc<PoolSet>, Vec<GenBackgroundService<Balancer>>)> {
        let registry = Arc::new(HealthRegistry::default());
        let mut services = Vec::new();
        let mut make = |name: String, pool: Pool, pc: &PoolConfig, model: Option<String>| {
            let (lb, infos) = balancer(&pc.backends, &pc.health_check, &registry, tls)?;
            let svc = background_service(&format!("health check {name}"), lb);
            let handle = PoolHandle {
                name,
                pool,
                balancer: svc.task(),
                model,
                runs_on: None,
                infos,
                usable: ArcSwapOption::empty(),
                // One per pool built, in order: the services collected so far.
                ordinal: services.len(),
            };
            services.push(svc);
            Ok::<_, std::io::Error>(handle)
        };
        let on_demand = make(
            "on-demand".into(),
            Pool::OnDemand,
            &cfg.pools.on_demand,
            None,
        )?;
        let spot = make("spot".into(), Pool::Spot, &cfg.pools.spot, None)?;
        let mut fallbacks = Vec::new();
        for f in &cfg.fallbacks {
            let (addr, _) = backend_of_url(&f.url).map_err(std::io::Error::other)?;
            let pc = PoolConfig {
                backends: vec![addr],
                health_check: cfg.pools.on_demand.health_check.clone(),
                // TLS is looked up per address in `tls`, where the URL's scheme is applied.
                ..Default::default()
            };
            let mut handle = make(
                format!("fallback:{}", f.name),
                Pool::Fallback,
                &pc,
                Some(f.model.clone()),
            )?;
            handle.runs_on = [
                (Pool::OnDemand, &cfg.pools.on_demand),
                (Pool::Spot, &cfg.pools.spot),
            ]
            .into_iter()
            .find(|(_, p)| p.backends.iter().any(|b| *b == pc.backends[0]))
            .map(|(pool, _)| pool);
            fallbacks.push(handle);
        }
        let set = PoolSet {
            on_demand,
            spot,
            fallbacks,
            registry,
            all_checked: Default::default(),
        };
        let backends: std::collections::HashSet<BackendKey> = set
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
        let _ = set.registry.expected.set(backends.len());
        Ok((Arc::new(set), services))
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

    /// A usable backend of `h` and its info, avoiding `exclude` (the one that just failed) when
    /// another is usable.
    pub fn select(&self, h: &PoolHandle, exclude: Option<&str>) -> Option<(Backend, BackendInfo)> {
        self.with_usable(h, |set| set.pick(h.ordinal, exclude))
    }

    pub fn healthy_count(&self, h: &PoolHandle) -> usize {
        self.with_usable(h, |set| set.backends.len())
    }

    pub fn any_usable(&self, h: &PoolHandle) -> bool {
        self.with_usable(h, |set| !set.backends.is_empty())
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
            .map(|b| (b.clone(), h.info(b)))
            .collect();
        let set = Arc::new(UsableSet {
            generation,
            backends,
        });
        h.usable.store(Some(Arc::clone(&set)));
        f(&set)
    }

    /// The first fallback pool with a usable backend.
    pub fn active_fallback(&self) -> Option<&PoolHandle> {
        self.fallbacks.iter().find(|h| self.any_usable(h))
    }

    pub fn handle(&self, pool: Pool) -> Option<&PoolHandle> {
        match pool {
            Pool::OnDemand => Some(&self.on_demand),
            Pool::Spot => Some(&self.spot),
            Pool::Fallback => self.active_fallback(),
        }
    }

    pub fn all(&self) -> impl Iterator<Item = &PoolHandle> {
        [&self.on_demand, &self.spot]
            .into_iter()
            .chain(self.fallbacks.iter())
    }

    pub fn status(&self, h: &PoolHandle) -> PoolStatus {
        let backends: Vec<BackendStatus> = h
            .balancer
            .backends()
            .get_backend()
            .iter()
            .map(|b| {
                let addr = b.addr.to_string();
                let r = self.registry.get(b);
                BackendStatus {
                    healthy: self.usable(h, b),
                    checked: r.last_check.is_some(),
                    last_error: r.last_error,
                    last_check_ms_ago: r.last_check.map(|t| t.elapsed().as_millis() as u64),
                    backend: addr,
                }
            })
            .collect();
        PoolStatus {
            name: h.name.clone(),
            healthy_backends: backends.iter().filter(|b| b.healthy).count(),
            backends,
            model: h.model.clone(),
        }
    }
}

fn balancer(
    addrs: &[String],
    hc_cfg: &HealthCheckConfig,
    registry: &Arc<HealthRegistry>,
    tls: &BackendTls,
) -> std::io::Result<(Balancer, Arc<BackendInfos>)> {
    use std::net::ToSocketAddrs;
    let mut backends = std::collections::BTreeSet::new();
    let mut infos = BackendInfos::new();
    let mut checks = HashMap::new();
    for addr in addrs {
        let tls = tls.get(addr);
        let sni = tls.map_or("", |t| t.sni.as_str());
        if !checks.contains_key(sni) {
            checks.insert(sni.to_string(), http_check(hc_cfg, tls.map(Arc::as_ref))?);
        }
        // A name may resolve to several addresses: each is a backend, as Pingora's own
        // `try_from_iter` makes them, carrying the name's TLS settings.
        for sock in addr.to_socket_addrs()? {
            backends.insert(Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(sock),
                weight: 1,
                ext: Default::default(),
            });
            // The first name of an address wins, as in the backend set.
            infos.entry(sock).or_insert_with(|| BackendInfo {
                name: sock.to_string().into(),
                tls: tls.cloned(),
            });
        }
    }
    let discovery = pingora::lb::discovery::Static::new(backends);
    let mut lb = Balancer::from_backends(pingora::lb::Backends::new(discovery));
    futures_util::FutureExt::now_or_never(lb.update())
        .ok_or_else(|| std::io::Error::other("static backend list did not load at once"))?
        .map_err(std::io::Error::other)?;
    let infos = Arc::new(infos);
    lb.set_health_check(Box::new(RecordingCheck {
        checks,
        infos: Arc::clone(&infos),
        config: hc_cfg.clone(),
        registry: Arc::clone(registry),
    }));
    lb.health_check_frequency = Some(Duration::from_millis(hc_cfg.interval_ms));
    lb.parallel_health_check = true;
    Ok((lb, infos))
}

/// Pingora's HTTP check of `hc_cfg.path`, over TLS with the backend's settings when it has
/// them. The `Host` of a TLS check is the server name, which a TLS front may route by.
fn http_check(
    hc_cfg: &HealthCheckConfig,
    tls: Option<&UpstreamTls>,
) -> std::io::Result<HttpHealthCheck> {
    let host = tls.map_or("localhost", |t| t.sni.as_str());
    let mut hc = HttpHealthCheck::new(host, tls.is_some());
    let mut req =
        RequestHeader::build("GET", hc_cfg.path.as_bytes(), None).map_err(std::io::Error::other)?;
    req.insert_header("Host", host)
        .map_err(std::io::Error::other)?;
    hc.req = req;
    hc.consecutive_success = hc_cfg.consecutive_success;
    hc.consecutive_failure = hc_cfg.consecutive_failure;
    let timeout = Some(Duration::from_millis(hc_cfg.timeout_ms));
    hc.peer_template.options.connection_timeout = timeout;
    hc.peer_template.options.read_timeout = timeout;
    if let Some(t) = tls {
        t.apply(&mut hc.peer_template);
    }
    Ok(hc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_of(addrs: &[&str]) -> UsableSet {
        UsableSet {
            generation: 0,
            backends: addrs
                .iter()
                .map(|a| {
                    let b = Backend::new(a).unwrap();
                    let name = b.addr.to_string().into();
                    (b, BackendInfo { name, tls: None })
                })
                .collect(),
        }
    }

    #[test]
    fn picks_rotate_over_the_usable_backends_and_avoid_the_one_that_failed() {
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        let names = |n: usize, exclude: Option<&str>| -> Vec<String> {
            (0..n)
                .map(|_| set.pick(0, exclude).unwrap().1.name.to_string())
                .collect()
        };
        let mut round = names(3, None);
        round.sort();
        assert_eq!(round, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        let avoiding = names(6, Some("127.0.0.1:2"));
        assert!(avoiding.iter().all(|n| n != "127.0.0.1:2"), "{avoiding:?}");
        assert!(avoiding.contains(&"127.0.0.1:1".to_string()));
        assert!(avoiding.contains(&"127.0.0.1:3".to_string()));
        // The backend that failed is still better than none.
        let only = set_of(&["127.0.0.1:9"]);
        let (b, info) = only.pick(0, Some("127.0.0.1:9")).unwrap();
        assert_eq!(
            (b.addr.to_string(), &*info.name),
            ("127.0.0.1:9".into(), "127.0.0.1:9")
        );
        assert!(set_of(&[]).pick(0, None).is_none());
    }

    /// Picks alternating between two pools on one thread still rotate within each pool.
    #[test]
    fn alternating_pools_each_rotate_over_their_backends() {
        let od = set_of(&["127.0.0.1:1", "127.0.0.1:2"]);
        let spot = set_of(&["127.0.0.1:3", "127.0.0.1:4"]);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..4 {
            seen.insert(od.pick(10, None).unwrap().1.name.to_string());
            seen.insert(spot.pick(11, None).unwrap().1.name.to_string());
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
    }

    #[test]
    fn passed_once_holds_per_backend_until_every_backend_has_passed() {
        let reg = HealthRegistry::default();
        let _ = reg.expected.set(2);
        let (a, b) = (
            Backend::new("127.0.0.1:1").unwrap(),
            Backend::new("127.0.0.1:2").unwrap(),
        );
        let fail: pingora::Result<()> = Err(pingora::Error::new_str("refused"));
        reg.record(BackendKey::of(&a), &fail);
        assert!(!reg.passed_once(&a));
        reg.record(BackendKey::of(&a), &Ok(()));
        reg.record(BackendKey::of(&a), &fail);
        assert!(
            reg.passed_once(&a),
            "a pass is remembered after a later failure"
        );
        assert!(!reg.passed_once(&b), "only the backend that passed");
        assert!(!reg.all_passed.load(Ordering::Relaxed));
        reg.record(BackendKey::of(&b), &Ok(()));
        assert!(reg.all_passed.load(Ordering::Relaxed));
        assert!(reg.passed_once(&a) && reg.passed_once(&b));
    }
}
