//! `pools:` and `fallbacks:`: the fleet behind Sluice. Any number of named pools, each with a
//! class (what tiers and spot eviction route by), the models it serves (declared, or discovered
//! from each backend's `/v1/models`) and how a replica is chosen inside it.

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use sluice_policy::Pool;
use std::fmt;
use std::path::PathBuf;

/// What a pool's capacity is: on-demand (guaranteed to stay) or spot (may be reclaimed; serves
/// Best-Effort and is left under its own pressure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum PoolClass {
    #[serde(rename = "on-demand")]
    OnDemand,
    #[serde(rename = "spot")]
    Spot,
}

impl PoolClass {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolClass::OnDemand => "on-demand",
            PoolClass::Spot => "spot",
        }
    }

    /// The policy's name for the class.
    pub fn pool(self) -> Pool {
        match self {
            PoolClass::OnDemand => Pool::OnDemand,
            PoolClass::Spot => Pool::Spot,
        }
    }
}

/// How a pool picks the replica for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    RoundRobin,
    /// The fewest requests Sluice has in flight there plus the queue vLLM reports, KV usage
    /// breaking ties.
    LeastLoad,
    /// Requests whose prompts share a head go to the same replica (its prefix cache holds that
    /// head) while its load stays within `load_bound` of the pool's mean; past it, the next
    /// replica on the ring.
    #[default]
    PrefixAffinity,
}

impl Selection {
    pub fn as_str(self) -> &'static str {
        match self {
            Selection::RoundRobin => "round_robin",
            Selection::LeastLoad => "least_load",
            Selection::PrefixAffinity => "prefix_affinity",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Default: `spot` for a pool named `spot`, else `on-demand`.
    pub class: Option<PoolClass>,
    /// The models (and LoRA adapters) every backend here serves. Unset: each backend's
    /// `/v1/models`, refreshed in the background, so an adapter loaded later is found.
    pub models: Option<Vec<String>>,
    /// `host:port` of each OpenAI-compatible backend (vLLM).
    pub backends: Vec<String>,
    pub health_check: HealthCheckConfig,
    /// TLS to every backend of the pool (off by default).
    pub tls: BackendTlsConfig,
    pub selection: Selection,
    /// Prefix affinity keeps a prompt head on its replica while that replica's requests in
    /// flight stay within this factor of the pool's mean (consistent hashing with bounded
    /// loads).
    pub load_bound: f64,
    /// Write each request's tier as vLLM's `priority` (Guaranteed 0, Standard 1, Best-Effort 2;
    /// lower first). Only for backends started with `--scheduling-policy priority`: vLLM
    /// refuses a non-zero priority otherwise.
    pub vllm_priority: bool,
    /// How many times a request that failed before any byte reached its client (connection
    /// refused or timed out, reset or closed before the response head, a 502, 503 or 504) is
    /// sent again, each time to a replica not tried yet: of this pool, then of another pool of
    /// its class serving its model. Within `routing.retry_budget`.
    pub retries: u32,
    /// Passive ejection: a replica that keeps failing is taken out of selection for a while.
    pub ejection: EjectionConfig,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            class: None,
            models: None,
            backends: Vec::new(),
            health_check: HealthCheckConfig::default(),
            tls: BackendTlsConfig::default(),
            selection: Selection::default(),
            load_bound: 1.25,
            vllm_priority: false,
            retries: 2,
            ejection: EjectionConfig::default(),
        }
    }
}

impl PoolConfig {
    pub fn with_backend(addr: &str) -> Self {
        Self {
            backends: vec![addr.into()],
            ..Default::default()
        }
    }
}

/// One pool and its name.
#[derive(Debug, Clone)]
pub struct NamedPool {
    pub name: String,
    pub config: PoolConfig,
    /// The fallback (by index) this pool was made for, when its URL is outside every pool.
    pub from_fallback: Option<usize>,
}

impl NamedPool {
    /// The keys that name a backend (by index) and the TLS block in messages.
    pub fn keys(&self) -> (impl Fn(usize) -> String + '_, String) {
        let base = match self.from_fallback {
            Some(i) => format!("fallbacks[{i}]"),
            None => format!("pools.{}", self.name),
        };
        let tls = format!("{base}.tls");
        let fallback = self.from_fallback.is_some();
        let addr = move |i: usize| {
            if fallback {
                format!("{base}.url")
            } else {
                format!("{base}.backends[{i}]")
            }
        };
        (addr, tls)
    }

    pub fn class(&self) -> PoolClass {
        self.config.class.unwrap_or(if self.name == "spot" {
            PoolClass::Spot
        } else {
            PoolClass::OnDemand
        })
    }
}

/// `pools:` in the file's order (the first pool of a class serving a model is that model's
/// pool of the class).
#[derive(Debug, Clone)]
pub struct PoolsConfig(pub Vec<NamedPool>);

impl Default for PoolsConfig {
    fn default() -> Self {
        PoolsConfig(vec![
            NamedPool {
                name: "on-demand".into(),
                config: PoolConfig::with_backend("127.0.0.1:8001"),
                from_fallback: None,
            },
            NamedPool {
                name: "spot".into(),
                config: PoolConfig::with_backend("127.0.0.1:8002"),
                from_fallback: None,
            },
        ])
    }
}

impl PoolsConfig {
    pub fn iter(&self) -> impl Iterator<Item = &NamedPool> {
        self.0.iter()
    }

    pub fn get(&self, name: &str) -> Option<&NamedPool> {
        self.0.iter().find(|p| p.name == name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut PoolConfig> {
        self.0
            .iter_mut()
            .find(|p| p.name == name)
            .map(|p| &mut p.config)
    }

    /// The first pool of `class`.
    pub fn first_of(&self, class: PoolClass) -> Option<&NamedPool> {
        self.0.iter().find(|p| p.class() == class)
    }
}

impl<'de> Deserialize<'de> for PoolsConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Ordered;
        impl<'de> Visitor<'de> for Ordered {
            type Value = PoolsConfig;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of pool names to pools")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PoolsConfig, A::Error> {
                let mut pools: Vec<NamedPool> = Vec::new();
                while let Some((name, config)) = map.next_entry::<String, PoolConfig>()? {
                    if pools.iter().any(|p| p.name == name) {
                        return Err(serde::de::Error::custom(format!(
                            "pool {name:?} is listed twice"
                        )));
                    }
                    pools.push(NamedPool {
                        name,
                        config,
                        from_fallback: None,
                    });
                }
                Ok(PoolsConfig(pools))
            }
        }
        d.deserialize_map(Ordered)
    }
}

/// A smaller model for requests moved off their pool under pressure. The first one served by a
/// pool with a healthy backend wins.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackTarget {
    pub name: String,
    pub model: String,
    /// The models whose requests may be moved to this one; default every other model.
    #[serde(default)]
    pub from: Option<Vec<String>>,
    /// `http://host:port` or `https://host:port` of a backend serving `model` outside every
    /// pool: it becomes a pool of its own (`fallback:<name>`). Unset: whichever pool serves
    /// `model`.
    #[serde(default)]
    pub url: Option<String>,
    /// SNI, CA and verification for an `https://` URL.
    #[serde(default)]
    pub tls: BackendTlsConfig,
}

impl FallbackTarget {
    /// Whether a request for `model` may move to this fallback.
    pub fn applies_to(&self, model: Option<&str>) -> bool {
        if model == Some(self.model.as_str()) {
            return false;
        }
        match (&self.from, model) {
            (None, _) => true,
            (Some(from), Some(m)) => from.iter().any(|f| f == m),
            (Some(_), None) => false,
        }
    }
}

/// `pools.<pool>.tls` and `fallbacks[].tls`: TLS from Sluice to a backend. Proxied requests,
/// health checks and the `/metrics` scrape all use it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendTlsConfig {
    /// For a fallback, its `https://` URL turns TLS on.
    pub enabled: bool,
    /// The server name sent and verified; default each backend's host part.
    pub sni: Option<String>,
    /// PEM bundle of the CAs to trust instead of the system's roots; relative to the config's
    /// directory.
    pub ca_file: Option<PathBuf>,
    /// Check the certificate chain and that it names `sni`. Off only for testing: anyone on
    /// the path could then read prompts and answers.
    pub verify: bool,
}

impl Default for BackendTlsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            sni: None,
            ca_file: None,
            verify: true,
        }
    }
}

/// `pools.<pool>.ejection`: Envoy's outlier detection by consecutive failures. A replica whose
/// last `consecutive_failures` requests failed (connect, reset, 5xx; slowness is no failure) is
/// left out of selection for `base_ejection_ms` × the times it was ejected (that count falls by
/// one for each `base_ejection_ms` it stays in), at most `max_ejection_ms`, never more than
/// `max_ejected_percent` of the pool's replicas at once. A health check that passes after one
/// failed during the ejection brings it back sooner.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EjectionConfig {
    /// 0 turns passive ejection off for the pool.
    pub consecutive_failures: u32,
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    pub max_ejected_percent: u32,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection_ms: 30_000,
            max_ejection_ms: 300_000,
            max_ejected_percent: 50,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// vLLM answers 200 on `/health` when its engine is alive.
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub consecutive_success: usize,
    pub consecutive_failure: usize,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            interval_ms: 1000,
            timeout_ms: 1000,
            consecutive_success: 1,
            consecutive_failure: 2,
        }
    }
}

impl BackendTlsConfig {
    /// The name sent as SNI to `addr` (`host:port`) and checked in its certificate: `sni`, or
    /// the host part (an IPv6 host without its brackets).
    pub fn server_name(&self, addr: &str) -> String {
        match &self.sni {
            Some(sni) => sni.clone(),
            None => {
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string()
            }
        }
    }
}

/// One backend address as Sluice reaches it, with the keys that name it in messages.
#[derive(Debug, Clone)]
pub struct BackendTarget {
    /// `host:port`.
    pub addr: String,
    /// `pools.spot.backends[1]`, `fallbacks[0].url`.
    pub addr_key: String,
    /// `pools.spot.tls`, `fallbacks[0].tls`.
    pub tls_key: String,
    pub tls: BackendTlsConfig,
}
