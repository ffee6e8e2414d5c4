//! The config file's shape. Every section has documented defaults, so an empty file is a valid
//! config pointing at 127.0.0.1:8001 (on-demand) and 127.0.0.1:8002 (spot).

use crate::pools::{FallbackTarget, PoolsConfig};
use serde::Deserialize;
use sluice_policy::adaptive::AdaptiveTuning;
use sluice_policy::fallback::FallbackTuning;
use sluice_policy::pressure::{Threshold, Thresholds};
use sluice_policy::slo::Slo;
use sluice_policy::stability::StabilityTuning;
use sluice_policy::tenant_policy::{PolicyRules, TierRules};
use sluice_policy::{PolicyMode, Pool, Tier};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The tenant-facing proxy listeners: they serve only the API they proxy.
    pub listen: Vec<String>,
    /// The operations listeners (probes, metrics, status, decisions, dashboard, admin):
    /// loopback by default; off loopback everything but the probes needs the admin token.
    pub ops_listen: Vec<String>,
    /// TLS proxy listeners; certificate and key are re-read on SIGHUP.
    pub listen_tls: Vec<TlsListenerConfig>,
    /// Pingora's own server settings (`threads`, `grace_period_seconds`, `upgrade_sock`, …).
    /// `threads` defaults to the machine's cores instead of Pingora's 1.
    pub server: serde_yaml::Mapping,
    /// A file in the seed's shape (`tenants: {name: Tier}`, optional `api_keys`), relative to
    /// this config's directory.
    pub tenants_file: Option<PathBuf>,
    pub tenants: BTreeMap<String, TenantEntry>,
    pub api_keys: Vec<ApiKey>,
    pub auth: AuthConfig,
    pub pools: PoolsConfig,
    pub fallbacks: Vec<FallbackTarget>,
    pub signals: SignalsConfig,
    pub policy: PolicyConfig,
    pub stability: StabilityConfig,
    pub fallback: FallbackConfig,
    pub queue: QueueConfig,
    pub tiers: TiersConfig,
    pub routing: RoutingConfig,
    pub limits: LimitsConfig,
    pub decisions: DecisionsConfig,
    pub metrics: MetricsConfig,
    /// PostgreSQL decision ledger (`SLUICE_DATABASE_URL`).
    pub database_url: Option<String>,
    /// How the ledger writes, spools and reads; used only when `database_url` is set.
    pub ledger: LedgerConfig,
    /// Redis admission coordinator (`SLUICE_REDIS_URL`).
    pub redis_url: Option<String>,
    /// How replicas share admission through Redis; read only when `redis_url` is set.
    pub coordination: CoordinationConfig,
    /// Prometheus signal source (`SLUICE_PROMETHEUS_URL`).
    pub prometheus_url: Option<String>,
    /// What Sluice exports beyond `/metrics`: distributed traces (`telemetry.tracing`).
    pub telemetry: TelemetryConfig,
    /// Where the config came from (for messages); not a key.
    #[serde(skip)]
    pub source: String,
    #[serde(skip)]
    pub tenants_source: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: vec!["127.0.0.1:8080".into()],
            ops_listen: vec!["127.0.0.1:8081".into()],
            server: serde_yaml::Mapping::new(),
            listen_tls: Vec::new(),
            tenants_file: None,
            tenants: BTreeMap::new(),
            api_keys: Vec::new(),
            auth: AuthConfig::default(),
            pools: PoolsConfig::default(),
            fallbacks: Vec::new(),
            signals: SignalsConfig::default(),
            policy: PolicyConfig::default(),
            stability: StabilityConfig::default(),
            fallback: FallbackConfig::default(),
            queue: QueueConfig::default(),
            tiers: TiersConfig::default(),
            routing: RoutingConfig::default(),
            limits: LimitsConfig::default(),
            decisions: DecisionsConfig::default(),
            metrics: MetricsConfig::default(),
            database_url: None,
            ledger: LedgerConfig::default(),
            redis_url: None,
            coordination: CoordinationConfig::default(),
            prometheus_url: None,
            telemetry: TelemetryConfig::default(),
            source: String::new(),
            tenants_source: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantsFile {
    pub tenants: BTreeMap<String, TenantEntry>,
    pub api_keys: Vec<ApiKey>,
}

/// One tenant: the prototype's `name: Tier`, or `name: {tier, weight, quota}` for its share of
/// a contended tier and its budget.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantEntry {
    pub tier: String,
    /// Share of a contended tier relative to the other tenants queued in it (default 1).
    pub weight: f64,
    pub quota: Option<QuotaConfig>,
    /// The tenant's requests may tighten their TTFT/TPOT targets with `x-llm-d-slo-ttft-ms` /
    /// `x-llm-d-slo-tpot-ms` (default true).
    pub slo_headers: bool,
}

impl TenantEntry {
    pub fn of_tier(tier: &str) -> Self {
        Self {
            tier: tier.to_string(),
            weight: 1.0,
            quota: None,
            slo_headers: true,
        }
    }
}

impl From<&str> for TenantEntry {
    fn from(tier: &str) -> Self {
        Self::of_tier(tier)
    }
}

pub use sluice_policy::bucket::QuotaConfig;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantDetail {
    tier: String,
    #[serde(default = "one")]
    weight: f64,
    #[serde(default)]
    quota: Option<QuotaConfig>,
    #[serde(default = "yes")]
    slo_headers: bool,
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

impl<'de> Deserialize<'de> for TenantEntry {
    /// A plain string keeps the prototype's files valid; a mapping must name its tier and may
    /// add only the known keys, so a typo fails with the key's name rather than "no variant".
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match serde_yaml::Value::deserialize(d)? {
            serde_yaml::Value::String(tier) => Ok(Self::of_tier(&tier)),
            v @ serde_yaml::Value::Mapping(_) => {
                let t: TenantDetail =
                    serde_yaml::from_value(v).map_err(serde::de::Error::custom)?;
                Ok(Self {
                    tier: t.tier,
                    weight: t.weight,
                    quota: t.quota,
                    slo_headers: t.slo_headers,
                })
            }
            _ => Err(serde::de::Error::custom(
                "a tenant is a tier name or a mapping {tier, weight, quota, slo_headers}",
            )),
        }
    }
}

/// An API key, stored only as the SHA-256 of the key (hex).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub tenant: String,
    pub sha256: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Refuse requests without a valid API key (401); `X-Tenant-ID` is then ignored.
    pub require_api_key: bool,
    /// Tier for a missing or unknown tenant when keys are not required; `reject` answers 401.
    pub unknown_tenant: String,
    /// Admin token for `/admin/*` (`SLUICE_ADMIN_TOKEN`); without one, admin answers loopback only.
    pub admin_token: Option<String>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            require_api_key: false,
            unknown_tenant: "Best-Effort".into(),
            admin_token: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SignalsConfig {
    /// Where pool signals come from (`SLUICE_SIGNALS_SOURCE`). Default `scrape`.
    pub source: SignalSource,
    /// How often backends' `/metrics` are scraped and the policy state advanced.
    pub scrape_interval_ms: u64,
    pub scrape_timeout_ms: u64,
    /// A sample older than this is unavailable, never used as if fresh. For Prometheus the age
    /// counts from the sample timestamp Prometheus returns.
    pub stale_after_ms: u64,
    /// How often Prometheus is queried; with `source: prometheus` also the policy's sample
    /// interval. Default 1000.
    pub prometheus_poll_ms: u64,
    /// Bound on each Prometheus query; past it the signal is unavailable. Default 500.
    pub prometheus_timeout_ms: u64,
    /// PromQL label matchers that select each pool's vLLM series. Default `pool="on-demand"` and
    /// `pool="spot"`; an empty spot selector leaves the spot pool unpolled.
    pub pool_selectors: PoolSelectors,
    /// The PromQL each pool's signal is read with; `{selector}` is replaced by the pool's
    /// selector, so `metric{{selector}}` becomes `metric{pool="spot"}`.
    pub queries: PrometheusQueries,
}

impl Default for SignalsConfig {
    fn default() -> Self {
        Self {
            source: SignalSource::default(),
            scrape_interval_ms: 1000,
            scrape_timeout_ms: 500,
            stale_after_ms: 5000,
            prometheus_poll_ms: 1000,
            prometheus_timeout_ms: 500,
            pool_selectors: PoolSelectors::default(),
            queries: PrometheusQueries::default(),
        }
    }
}

/// `signals.source`. With `both`, a signal Prometheus cannot give (unreachable, empty, stale …)
/// is taken from the direct scrape, and the scraper alone advances the policy so samples are
/// not counted twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SignalSource {
    /// Each backend's `/metrics`, directly (no Prometheus needed).
    #[default]
    Scrape,
    /// Prometheus' query API at `prometheus_url` only.
    Prometheus,
    /// Prometheus first, the direct scrape when Prometheus has no usable value.
    Both,
}

impl SignalSource {
    pub fn as_str(self) -> &'static str {
        match self {
            SignalSource::Scrape => "scrape",
            SignalSource::Prometheus => "prometheus",
            SignalSource::Both => "both",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scrape" => Some(SignalSource::Scrape),
            "prometheus" => Some(SignalSource::Prometheus),
            "both" => Some(SignalSource::Both),
            _ => None,
        }
    }
    /// The direct `/metrics` scraper runs.
    pub fn scrapes(self) -> bool {
        self != SignalSource::Prometheus
    }
    /// The Prometheus poller runs.
    pub fn polls_prometheus(self) -> bool {
        self != SignalSource::Scrape
    }
}

/// `signals.pool_selectors`: PromQL label matchers, without braces, by pool name. A pool not
/// listed is selected by `pool="<name>"`; an empty selector leaves the pool unpolled.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct PoolSelectors(pub BTreeMap<String, String>);

impl PoolSelectors {
    pub fn of(&self, pool: &str) -> String {
        self.0
            .get(pool)
            .cloned()
            .unwrap_or_else(|| format!("pool=\"{pool}\""))
    }
}

/// `signals.queries`: each must return one series (or a scalar).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusQueries {
    /// KV-cache usage as a 0–1 fraction (Sluice reports it in percent). The default averages
    /// over engines and backends and reads vLLM ≥ 0.10's name, else the older one.
    pub kv_usage: String,
    /// vLLM's waiting requests; the default sums over engines and backends.
    pub waiting: String,
}

impl Default for PrometheusQueries {
    fn default() -> Self {
        Self {
            kv_usage: "avg(vllm:kv_cache_usage_perc{{selector}}) or avg(vllm:gpu_cache_usage_perc{{selector}})".into(),
            waiting: "sum(vllm:num_requests_waiting{{selector}})".into(),
        }
    }
}

/// `policy:`: which governance runs, and the adaptive controller's knobs.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// `adaptive` (SLO feedback per pool, the default) or `thresholds` (the prototype's static
    /// per-tier thresholds on on-demand's signals).
    pub mode: String,
    /// The controller's knobs, read straight into the policy core's tuning.
    pub adaptive: AdaptiveTuning,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            mode: PolicyMode::default().as_str().into(),
            adaptive: AdaptiveTuning::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StabilityConfig {
    pub consecutive_samples: u32,
    pub cooldown_seconds: f64,
    pub hysteresis: f64,
    pub queue_depth_hysteresis: f64,
    pub sla_rate_hysteresis: f64,
}

impl Default for StabilityConfig {
    fn default() -> Self {
        let t = StabilityTuning::default();
        Self {
            consecutive_samples: t.consecutive_samples,
            cooldown_seconds: t.cooldown_ms as f64 / 1000.0,
            hysteresis: t.hysteresis,
            queue_depth_hysteresis: t.queue_depth_hysteresis,
            sla_rate_hysteresis: t.sla_rate_hysteresis,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FallbackConfig {
    pub pressure_at: f64,
    pub recover_below: f64,
    pub sustained_intervals: u32,
    pub cooldown_seconds: f64,
}

impl Default for FallbackConfig {
    fn default() -> Self {
        let t = FallbackTuning::default();
        Self {
            pressure_at: t.pressure_at,
            recover_below: t.recover_below,
            sustained_intervals: t.sustained_intervals,
            cooldown_seconds: t.cooldown_ms as f64 / 1000.0,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Queued requests per tier, across the deployment.
    pub max_size: usize,
    pub max_wait_seconds: f64,
    /// How often a distributed queue re-checks its head; the in-process queue is woken directly.
    pub poll_seconds: f64,
    /// A freed slot goes to the queued tenant with the least weighted token service (FIFO within
    /// a tenant); `false` is plain FIFO across tenants.
    pub fair_share: bool,
    /// How fast a tenant's past excess service is forgiven when it queues again.
    pub fair_share_half_life_seconds: f64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_size: 100,
            max_wait_seconds: 2.0,
            poll_seconds: 0.05,
            fair_share: true,
            fair_share_half_life_seconds: 60.0,
        }
    }
}

impl QueueConfig {
    pub fn fair_share_half_life_ms(&self) -> u64 {
        (self.fair_share_half_life_seconds * 1000.0).round() as u64
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersConfig {
    #[serde(rename = "Guaranteed")]
    pub guaranteed: TierConfig,
    #[serde(rename = "Standard")]
    pub standard: TierConfig,
    #[serde(rename = "Best-Effort")]
    pub best_effort: TierConfig,
}

impl TiersConfig {
    pub fn get(&self, tier: Tier) -> &TierConfig {
        match tier {
            Tier::Guaranteed => &self.guaranteed,
            Tier::Standard => &self.standard,
            Tier::BestEffort => &self.best_effort,
        }
    }
}

/// Every key is optional and falls back to the tier's built-in default. A signal block under
/// `thresholds` replaces that signal's default whole: a step left out of it is disabled.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// The prototype's end-to-end target: `slo.e2e_ms` (which wins when both are set).
    pub sla_target_ms: Option<u64>,
    /// Targets in the units users set them; any subset. Given, it replaces the tier's default
    /// objective whole (with `sla_target_ms` as its end-to-end target when it sets none).
    pub slo: Option<SloConfig>,
    /// 0 = unlimited.
    pub inflight_capacity: Option<u32>,
    /// `max_tokens` cap in the Elevated state; `0` disables the degrade step.
    pub max_tokens_cap: Option<u32>,
    /// Adaptive mode's deeper cap, after the cap and before the fallback or shedding; `0`
    /// disables the step.
    pub brownout_max_tokens: Option<u32>,
    pub queue: Option<bool>,
    pub fallback: Option<bool>,
    /// `on-demand` or `spot`.
    pub pool: Option<String>,
    pub thresholds: ThresholdsConfig,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloConfig {
    pub ttft_ms: Option<u64>,
    pub tpot_ms: Option<u64>,
    pub e2e_ms: Option<u64>,
}

/// A tier's objective when its config sets none: the shipped `conf/sluice.yaml`'s, in the units
/// users set (interactive serving's usual targets: MLPerf's llama2-70b-interactive asks 450 ms to
/// the first token and 40 ms a token, Dynamo's planner defaults to 500 / 50).
pub fn default_slo(tier: Tier) -> Slo {
    let (ttft, tpot) = match tier {
        Tier::Guaranteed => (500, 50),
        Tier::Standard => (1000, 100),
        Tier::BestEffort => (2000, 200),
    };
    Slo {
        ttft_ms: Some(ttft),
        tpot_ms: Some(tpot),
        e2e_ms: None,
    }
}

impl TierConfig {
    /// The tier's objective: `slo` when given, else the end-to-end target alone; `None` leaves
    /// the built-in default.
    pub fn objective(&self) -> Option<Slo> {
        match (self.slo, self.sla_target_ms) {
            (Some(s), e2e) => Some(Slo {
                ttft_ms: s.ttft_ms,
                tpot_ms: s.tpot_ms,
                e2e_ms: s.e2e_ms.or(e2e),
            }),
            (None, Some(e2e)) => Some(Slo::e2e(e2e)),
            (None, None) => None,
        }
    }

    /// Set both `slo.e2e_ms` and `sla_target_ms`: `sluice check` says which is in force.
    pub fn e2e_conflict(&self) -> Option<(u64, u64)> {
        self.slo.and_then(|s| s.e2e_ms).zip(self.sla_target_ms)
    }
}

impl Config {
    /// Each tier's objective in force, as `sluice check` prints it, with a note where
    /// `sla_target_ms` and `slo.e2e_ms` are both set.
    pub fn objectives(&self) -> Vec<String> {
        let rules = policy_rules(self);
        Tier::ALL
            .into_iter()
            .map(|tier| {
                let slo = rules.tier(tier).slo;
                let dims: Vec<String> = slo
                    .dims()
                    .map(|d| format!("{} {} ms", d.as_str(), slo.get(d).unwrap_or(0)))
                    .collect();
                let mut line = format!(
                    "tiers.{}: {}",
                    tier.as_str(),
                    if dims.is_empty() {
                        "no objective (never judged late)".to_string()
                    } else {
                        dims.join(", ")
                    }
                );
                if let Some((e2e, sla)) = self.tiers.get(tier).e2e_conflict() {
                    line.push_str(&format!(
                        "; slo.e2e_ms ({e2e}) is in force, sla_target_ms ({sla}) is ignored"
                    ));
                }
                line
            })
            .collect()
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThresholdsConfig {
    pub pressure: Option<ThresholdConfig>,
    pub queue_depth: Option<ThresholdConfig>,
    pub sla_violation_rate: Option<ThresholdConfig>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThresholdConfig {
    pub elevated_at: Option<f64>,
    pub critical_at: Option<f64>,
}

impl From<ThresholdConfig> for Threshold {
    fn from(t: ThresholdConfig) -> Self {
        Threshold::new(t.elevated_at, t.critical_at)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Spot's own KV pressure at which Best-Effort is evicted to on-demand.
    pub spot_evict_pressure_at: Option<f64>,
    /// Spot's own waiting queue at which Best-Effort is evicted to on-demand.
    pub spot_evict_queue_depth_at: Option<f64>,
    /// How often each backend of a pool without declared `models` is asked its `/v1/models`
    /// (every second until each has answered once).
    pub models_refresh_ms: u64,
    pub models_timeout_ms: u64,
    /// Retries after failures before the first byte are at most this share of each pool's
    /// requests, so a fleet-wide outage is not multiplied.
    pub retry_budget: RetryBudgetConfig,
}

/// `routing.retry_budget`: per pool, retries over the last `window_ms` may be at most `ratio` of
/// the requests first sent there in that window, or `min_retries`, whichever is more (on a quiet
/// pool the failures that get a dead replica ejected are still retried). Linkerd's retry budget,
/// by window.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    pub ratio: f64,
    pub window_ms: u64,
    pub min_retries: u32,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            window_ms: 10_000,
            min_retries: 10,
        }
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        let t = PolicyRules::default().spot_eviction;
        Self {
            spot_evict_pressure_at: t.pressure.critical_at,
            spot_evict_queue_depth_at: t.queue_depth.critical_at,
            models_refresh_ms: 10_000,
            models_timeout_ms: 1000,
            retry_budget: RetryBudgetConfig::default(),
        }
    }
}

/// One TLS listener: its address and PEM files (relative to the config's directory).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsListenerConfig {
    pub listen: String,
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    pub upstream_connect_timeout_ms: u64,
    /// Per read from the backend: bounds time to first token and each gap between stream chunks,
    /// not the whole generation.
    pub upstream_read_timeout_ms: u64,
    /// How long a pooled upstream connection may idle; below uvicorn's 5 s keep-alive.
    pub upstream_idle_timeout_ms: u64,
    /// Request line plus headers, in bytes; larger gets 431.
    pub max_header_bytes: usize,
    /// Header fields per request; more gets 431. At most Pingora's own 256.
    pub max_headers: usize,
    /// The request line (method, target, version); longer gets 414.
    pub max_request_line_bytes: usize,
    /// From a connection's first byte (or its accept) to the end of the request header; a
    /// client still sending its header then is disconnected (slowloris).
    pub header_read_timeout_ms: u64,
    /// Longest gap between two reads of a request body from the client.
    pub body_read_timeout_ms: u64,
    /// How long an idle keep-alive connection waits for its next request.
    pub keepalive_timeout_ms: u64,
    /// Open client connections per listener; past it new connections get 503 + Retry-After.
    pub max_connections: usize,
    /// After a refusal sent before the body was read, up to this many body bytes are read and
    /// discarded so the client, still sending, sees the answer instead of a reset.
    pub refused_body_drain_bytes: usize,
    /// Time bound of that drain.
    pub refused_body_drain_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 * 1024 * 1024,
            upstream_connect_timeout_ms: 1000,
            upstream_read_timeout_ms: 120_000,
            upstream_idle_timeout_ms: 4000,
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            max_request_line_bytes: 8 * 1024,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            keepalive_timeout_ms: 60_000,
            max_connections: 10_000,
            refused_body_drain_bytes: 16 * 1024 * 1024,
            refused_body_drain_ms: 5_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecisionsConfig {
    /// Recent decisions answered by `/decisions/recent` from memory. Each worker thread keeps
    /// up to this many of its own (so the newest `ring_size` overall are always there).
    pub ring_size: usize,
    /// Whether the request log line carries the policy inputs replay needs (~0.5 KB a line).
    /// Unset: only when there is no ledger, which records them otherwise.
    pub log_inputs: Option<bool>,
    /// Which requests get a JSON log line (at `RUST_LOG` info).
    pub log_requests: LogRequests,
}

impl Default for DecisionsConfig {
    fn default() -> Self {
        Self {
            ring_size: 1000,
            log_inputs: None,
            log_requests: LogRequests::Auto,
        }
    }
}

/// Which requests are written to the log. A line costs as much as the rest of Sluice's
/// decision (building ~1 KB of JSON, and the write and disk behind stderr); with a ledger every
/// line is already a durable row, so by default the log then keeps only what an operator
/// reading it looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogRequests {
    /// `all` without a ledger (the log is then the only durable record and replay's input),
    /// `exceptions` with one.
    Auto,
    All,
    /// Requests not plainly served: any decision but pass, a status of 400 or more, an error,
    /// or a missed SLA target.
    Exceptions,
    Off,
}

impl LogRequests {
    /// What `auto` means for this deployment.
    pub fn resolve(self, ledger: bool) -> Self {
        match self {
            Self::Auto if ledger => Self::Exceptions,
            Self::Auto => Self::All,
            other => other,
        }
    }
}

/// `/metrics` options. Every label set is bounded: tenants are unbounded, so a tenant label is
/// off unless asked for, and then capped.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Export `sluice_tenant_requests_total{tenant,tier,decision}`.
    pub tenant_label: bool,
    /// Distinct tenants given their own label value; later ones are counted as `other`.
    pub max_tenants: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            tenant_label: false,
            max_tenants: 100,
        }
    }
}

/// `telemetry:`. The signal sources and `/metrics` have their own sections (`signals`,
/// `prometheus_url`, `metrics`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Distributed tracing: a SERVER span per request and a CLIENT span per upstream attempt,
    /// exported as OTLP over HTTP. Off by default; the `OTEL_*` variables override the file
    /// (`sluice_trace::config`), `SLUICE_TRACING_ENABLED` turns it on. Fixed for the process: a
    /// reload does not change it.
    pub tracing: sluice_trace::TracingConfig,
}

/// The Redis admission coordinator's knobs (`coordination:`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinationConfig {
    /// Namespace of every Redis key (`<prefix>:<tier>:slots`, …), so deployments and test runs
    /// can share one Redis. Default `sluice`; `SLUICE_REDIS_PREFIX` overrides it.
    pub redis_prefix: String,
    /// How long a held slot survives without renewal. Replicas renew every `lease_seconds / 3`,
    /// so the slots of a replica that died return to the pool within `lease_seconds`. Default 5.
    pub lease_seconds: f64,
    /// Bound on every Redis call; admission fails open past it, so a hung Redis cannot stall
    /// requests. Default 250.
    pub op_timeout_ms: u64,
    /// Lease blocks of slots to each replica while a tier (capacity ≥ 64, or unlimited) is far
    /// from its bound, so most admissions need no Redis round trip. Default true.
    pub capacity_credits: bool,
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        Self {
            redis_prefix: "sluice".into(),
            lease_seconds: 5.0,
            op_timeout_ms: 250,
            capacity_credits: true,
        }
    }
}

impl CoordinationConfig {
    pub fn lease_ms(&self) -> u64 {
        secs_to_ms(self.lease_seconds)
    }
}

/// The PostgreSQL decision ledger's knobs (`ledger:`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    /// How often the writer sends buffered rows to PostgreSQL, in ms. Default 100: half of 200's
    /// COPY burst, which is what the proxy's p99 waits behind at high concurrency, for the same
    /// throughput (measured when it landed; see this file's git history).
    pub flush_interval_ms: u64,
    /// Rows per batch (one `COPY`); a flush also starts as soon as this many rows are buffered.
    /// Default 5000: more than one flush interval holds at one replica's rates, so batches go out
    /// by time (why: bench/RESULTS.md, "Ledger batches by time").
    pub batch_rows: usize,
    /// Rows held in memory while PostgreSQL is slow or down before they spill to the spool
    /// (at half of it). Default 20000: two full batches before spilling.
    pub buffer_rows: usize,
    /// Directory of the append-only spool (JSON lines) that keeps rows PostgreSQL could not
    /// take, replayed once it is back. Absolute path. Default `/tmp/sluice-spool`
    /// (`SLUICE_SPOOL_DIR`).
    pub spool_dir: PathBuf,
    /// Disk the spool may use; rows beyond it are dropped, counted and logged.
    /// Default 268435456 (256 MiB).
    pub spool_max_bytes: u64,
    /// Rows older than this are deleted in the background, in small batches. Default 30.
    pub retention_days: u32,
    /// The SLA-violation rate fed to the policy is computed over requests completed in this
    /// many seconds. Default 60.
    pub sla_window_seconds: u64,
    /// Also bound the SLA window to the last N completed requests; 0 = no bound. Default 0.
    pub sla_window_requests: u64,
    /// PostgreSQL schema holding the ledger's tables, created if missing (`SLUICE_LEDGER_SCHEMA`).
    /// Default `public`.
    pub schema: String,
    /// Whether a batch counts as written only once PostgreSQL has flushed its WAL to disk
    /// (`synchronous_commit` of the writer's sessions). `false` saves the flush per batch but a
    /// PostgreSQL crash (not an outage: the spool covers that) can then lose the last few
    /// hundred milliseconds of batches Sluice already let go. Default true.
    pub synchronous_commit: bool,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            flush_interval_ms: 100,
            batch_rows: 5_000,
            buffer_rows: 20_000,
            spool_dir: PathBuf::from("/tmp/sluice-spool"),
            spool_max_bytes: 256 * 1024 * 1024,
            retention_days: 30,
            sla_window_seconds: 60,
            sla_window_requests: 0,
            schema: "public".into(),
            synchronous_commit: true,
        }
    }
}

fn secs_to_ms(s: f64) -> u64 {
    (s * 1000.0).round().max(0.0) as u64
}

/// A token cap as configured: `0` turns the step off, absent keeps the tier's default.
fn zero_is_off(configured: Option<u32>, default: Option<u32>) -> Option<u32> {
    match configured {
        Some(0) => None,
        Some(n) => Some(n),
        None => default,
    }
}

pub(crate) fn policy_rules(cfg: &Config) -> PolicyRules {
    let defaults = PolicyRules::default();
    let tiers = Tier::ALL.map(|tier| {
        let d = defaults.tier(tier).clone();
        let c = cfg.tiers.get(tier);
        let th = &c.thresholds;
        TierRules {
            thresholds: Thresholds {
                pressure: th.pressure.map(Into::into).unwrap_or(d.thresholds.pressure),
                queue_depth: th
                    .queue_depth
                    .map(Into::into)
                    .unwrap_or(d.thresholds.queue_depth),
                sla_violation_rate: th
                    .sla_violation_rate
                    .map(Into::into)
                    .unwrap_or(d.thresholds.sla_violation_rate),
            },
            max_tokens_cap: zero_is_off(c.max_tokens_cap, d.max_tokens_cap),
            brownout_max_tokens: zero_is_off(c.brownout_max_tokens, d.brownout_max_tokens),
            queue_eligible: c.queue.unwrap_or(d.queue_eligible),
            fallback_eligible: c.fallback.unwrap_or(d.fallback_eligible),
            preferred_pool: match c.pool.as_deref() {
                Some("spot") => Pool::Spot,
                Some(_) => Pool::OnDemand,
                None => d.preferred_pool,
            },
            slo: c.objective().unwrap_or(default_slo(tier)),
            inflight_capacity: c.inflight_capacity.unwrap_or(d.inflight_capacity),
        }
    });
    PolicyRules {
        mode: PolicyMode::parse(&cfg.policy.mode).unwrap_or_default(),
        tiers,
        adaptive: cfg.policy.adaptive.clone(),
        stability: StabilityTuning {
            consecutive_samples: cfg.stability.consecutive_samples,
            cooldown_ms: secs_to_ms(cfg.stability.cooldown_seconds),
            hysteresis: cfg.stability.hysteresis,
            queue_depth_hysteresis: cfg.stability.queue_depth_hysteresis,
            sla_rate_hysteresis: cfg.stability.sla_rate_hysteresis,
        },
        fallback: FallbackTuning {
            pressure_at: cfg.fallback.pressure_at,
            recover_below: cfg.fallback.recover_below,
            sustained_intervals: cfg.fallback.sustained_intervals,
            cooldown_ms: secs_to_ms(cfg.fallback.cooldown_seconds),
        },
        spot_eviction: Thresholds {
            pressure: Threshold::new(None, cfg.routing.spot_evict_pressure_at),
            queue_depth: Threshold::new(None, cfg.routing.spot_evict_queue_depth_at),
            sla_violation_rate: Threshold::default(),
        },
        fallback_capacity: cfg.fallback_capacity(),
        spot_is_on_demand: cfg.spot_is_on_demand(),
    }
}

impl QueueConfig {
    pub fn max_wait_ms(&self) -> u64 {
        secs_to_ms(self.max_wait_seconds)
    }
    pub fn poll_ms(&self) -> u64 {
        secs_to_ms(self.poll_seconds).max(1)
    }
}
