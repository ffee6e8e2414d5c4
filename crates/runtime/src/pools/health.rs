//! Backend health: Pingora's HTTP check of each backend, recorded for the health rule and
//! `/status`.
//!
//! Health rule: a backend is usable only once a health check has *passed* since start and
//! Pingora still counts it healthy. Pingora starts every backend healthy; we do not, so a dead
//! backend is never picked in the window before its first check.

use super::{BackendInfo, BackendInfos, Balancer};
use crate::backend_tls::{BackendTls, UpstreamTls};
use crate::fleet::BackendLoads;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora::lb::health_check::{HealthCheck, HttpHealthCheck};
use pingora::lb::Backend;
use sluice_config::HealthCheckConfig;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub(super) struct CheckRecord {
    passed_once: bool,
    last_ok: bool,
    pub(super) last_error: Option<String>,
    pub(super) last_check: Option<Instant>,
}

/// What the health checks have seen, keyed by backend address. Read on every request (the health
/// rule), written once per check: a read-write lock over a map keyed by the address itself, so a
/// lookup neither allocates nor contends with other requests.
#[derive(Debug, Default)]
pub struct HealthRegistry {
    records: RwLock<HashMap<BackendKey, CheckRecord>>,
    /// How many distinct backends the pool set has, known once it is built.
    pub(super) expected: std::sync::OnceLock<usize>,
    /// Every backend has passed a check: `passed_once` never goes back, so from then on a
    /// request answers it without the lock, whose shared counter both workers' cores would
    /// otherwise pull back and forth several times a request.
    all_passed: std::sync::atomic::AtomicBool,
    /// Bumped after anything that can change whether a backend is usable: a backend's first
    /// pass, and every flip of Pingora's health (reported after the flip is stored). The
    /// pools' cached answers are valid for one value of it.
    pub(super) generation: AtomicU64,
}

/// Backends are TCP addresses; `Display` only for the rare other kind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum BackendKey {
    Inet(std::net::SocketAddr),
    Other(String),
}

impl BackendKey {
    pub(super) fn of(b: &Backend) -> Self {
        match b.addr.as_inet() {
            Some(a) => BackendKey::Inet(*a),
            None => BackendKey::Other(b.addr.to_string()),
        }
    }
}

impl HealthRegistry {
    pub(super) fn record(&self, key: BackendKey, result: &pingora::Result<()>) {
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

    pub(super) fn get(&self, b: &Backend) -> CheckRecord {
        let map = self.records.read().unwrap_or_else(|e| e.into_inner());
        map.get(&BackendKey::of(b)).cloned().unwrap_or_default()
    }

    pub(super) fn passed_once(&self, b: &Backend) -> bool {
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
        // A replica ejected for failing requests comes back once a check that passes follows
        // one that failed during the ejection.
        let info = target.addr.as_inet().and_then(|a| self.infos.get(a));
        if let Some(info) = info {
            if info.passive.checked(result.is_ok(), Instant::now()) {
                self.registry.generation.fetch_add(1, Ordering::Release);
                log::warn!(
                    "{}",
                    serde_json::json!({"event": "backend_returned", "backend": &*info.name,
                                       "why": "health_check_passed"})
                );
            }
        }
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

/// A pool's balancer over `addrs` (each name resolved to its addresses), health-checked by
/// `hc_cfg` into `registry`, and each backend's info with its load in `loads`.
pub(super) fn balancer(
    addrs: &[String],
    hc_cfg: &HealthCheckConfig,
    registry: &Arc<HealthRegistry>,
    tls: &BackendTls,
    loads: &mut BackendLoads,
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
            let name = sock.to_string();
            let load = loads.register(addr, &name);
            infos.entry(sock).or_insert_with(|| BackendInfo {
                name: name.into(),
                tls: tls.cloned(),
                load,
                passive: Default::default(),
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
pub(super) fn http_check(
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
