//! What `/status` shows, as types: built from the services' handles, serialised only when the
//! answer is written.

use serde::Serialize;
use sluice_policy::adaptive::{Movement, RailKind};
use sluice_policy::pressure::{Threshold, Thresholds};
use sluice_runtime::admission::{CoordinatorHealth, TenantShare};
use sluice_runtime::pools::PoolStatus;
use sluice_runtime::quota::QuotaStatus;
use sluice_runtime::signals::health::PrometheusStatus;
use sluice_runtime::signals::hub::{BackendScrape, SignalReading};
use std::collections::BTreeMap;

#[derive(Debug, Serialize)]
pub struct Status {
    pub replica: String,
    pub uptime_seconds: u64,
    pub coordinator: &'static str,
    pub policy_mode: &'static str,
    pub policy_sampled_ms_ago: u64,
    pub admission_control: AdmissionControl,
    /// Which pools serve which model.
    pub routes: Routes,
    /// By pool name.
    pub signals: BTreeMap<&'static str, PoolSignals>,
    pub tiers: Vec<TierStatus>,
    pub spot_state: &'static str,
    pub spot_eviction: ThresholdsView,
    pub fallback: Fallback,
    pub pools: Vec<PoolStatus>,
    pub admission: CoordinatorHealth,
    pub quotas: QuotaStatus,
    /// Each decision sink's own status.
    pub ledger: Vec<serde_json::Value>,
    pub telemetry: Telemetry,
    /// Each configured external dependency and whether it is up now.
    pub dependencies: BTreeMap<&'static str, bool>,
}

#[derive(Debug, Serialize)]
pub struct Routes {
    /// Bumped each time discovery changes what a pool serves.
    pub generation: u64,
    /// Every pool's models are known: a model none serves is answered 404 by Sluice.
    pub complete: bool,
    pub models: Vec<ModelRoute>,
}

#[derive(Debug, Serialize)]
pub struct ModelRoute {
    pub model: String,
    /// The pool its on-demand traffic goes to (for a model only spot serves, that pool).
    pub pool: &'static str,
    /// The pool its Best-Effort traffic prefers.
    pub spot_pool: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct PoolSignals {
    /// By signal name (`pressure`, `queue_depth`, `sla_violation_rate`).
    #[serde(flatten)]
    pub readings: BTreeMap<&'static str, SignalReading>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scraped_backends: Option<Vec<BackendScrape>>,
}

#[derive(Debug, Serialize)]
pub struct TierStatus {
    pub tier: &'static str,
    pub state: &'static str,
    pub capacity: u32,
    pub inflight: u64,
    pub idle_credits: u64,
    pub queued: u64,
    /// Least served first: the head of this list is served next.
    pub waiting_tenants: Vec<TenantShare>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sla_target_ms: Option<u64>,
    /// The tier's objective: `ttft_ms`, `tpot_ms`, `e2e_ms`, those set.
    pub slo: std::collections::BTreeMap<&'static str, u64>,
    pub max_tokens_cap: Option<u32>,
    pub brownout_max_tokens: Option<u32>,
    pub pool: &'static str,
    #[serde(flatten)]
    pub mode: TierMode,
}

/// What the thresholds mode adds to a tier; in adaptive mode the thresholds decide nothing and
/// their stability model's driver names no cause, so they are shown as not in force.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TierMode {
    Thresholds {
        driver: &'static str,
        fail_open: bool,
        thresholds: ThresholdsView,
    },
    Adaptive {
        thresholds_mode: ThresholdsNotInForce,
    },
}

#[derive(Debug, Serialize)]
pub struct ThresholdsNotInForce {
    pub in_force: bool,
    pub thresholds: ThresholdsView,
}

#[derive(Debug, Serialize)]
pub struct ThresholdsView {
    pub pressure: ThresholdView,
    pub queue_depth: ThresholdView,
    pub sla_violation_rate: ThresholdView,
}

#[derive(Debug, Serialize)]
pub struct ThresholdView {
    pub elevated_at: Option<f64>,
    pub critical_at: Option<f64>,
}

impl From<&Thresholds> for ThresholdsView {
    fn from(t: &Thresholds) -> Self {
        let one = |t: Threshold| ThresholdView {
            elevated_at: t.elevated_at,
            critical_at: t.critical_at,
        };
        ThresholdsView {
            pressure: one(t.pressure),
            queue_depth: one(t.queue_depth),
            sla_violation_rate: one(t.sla_violation_rate),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Fallback {
    /// Sustained pressure and a usable target: fallback traffic is being routed.
    pub active: bool,
    pub sustained_pressure: bool,
    pub target: Option<String>,
    pub model: Option<String>,
}

/// Adaptive mode, per pool: the level, what each step does and how much of it applies, each
/// tier's headroom and latency, and why the level last moved.
#[derive(Debug, Serialize)]
pub struct AdmissionControl {
    pub enabled: bool,
    pub shared_capacity: bool,
    pub pools: BTreeMap<&'static str, PoolAdmission>,
}

#[derive(Debug, Serialize)]
pub struct PoolAdmission {
    pub level: f64,
    pub max_level: usize,
    pub steps: Vec<StepView>,
    /// By tier name.
    pub tiers: BTreeMap<&'static str, TierControl>,
    pub vllm_queue_delay_ms: Option<f64>,
    pub moved: Moved,
    pub saturated: bool,
    pub shaping: bool,
    /// KV usage at `fallback_pressure_at`: what may fall back is moving off this pool.
    pub filling: Option<bool>,
    pub idle: bool,
    /// At the last sample vLLM queued, the cache was at `idle_pressure_below` or the batch ate
    /// a TPOT budget: Standard then starts nowhere on Guaranteed's pool while Guaranteed's
    /// first-token target is tight (`reserve_guaranteed_pool`).
    pub busy: bool,
    pub work_limit_tokens: Option<f64>,
    pub inflight_work_tokens: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct StepView {
    pub tier: &'static str,
    pub action: &'static str,
    pub applies_to: f64,
}

#[derive(Debug, Serialize)]
pub struct TierControl {
    pub headroom: Option<f64>,
    pub unloaded_latency_ms: Option<f64>,
    pub target_unattainable: bool,
    pub latency_p_ms: Option<f64>,
    pub lead_p_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sla_target_ms: Option<u64>,
    /// Per dimension of the tier's objective (`ttft`, `tpot`, `e2e`): its reading on the pool.
    pub slo: std::collections::BTreeMap<&'static str, DimControl>,
    pub capped: f64,
    pub fallback: f64,
    pub shed: f64,
}

/// One dimension of a tier's objective on one pool.
#[derive(Debug, Serialize)]
pub struct DimControl {
    pub target_ms: Option<u64>,
    pub headroom: Option<f64>,
    /// The tier's quantile on this dimension over the window.
    pub observed_p_ms: Option<f64>,
    pub unloaded_ms: Option<f64>,
    pub target_unattainable: bool,
    /// Share of the window's requests over the target on this dimension.
    pub missed: f64,
}

/// Which way the level last moved, and why.
#[derive(Debug, Serialize)]
pub struct Moved {
    pub direction: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom: Option<f64>,
}

impl From<Movement> for Moved {
    fn from(m: Movement) -> Self {
        let moved = |direction, why: &str| Moved {
            direction,
            why: Some(why.to_string()),
            tier: None,
            headroom: None,
        };
        match m {
            Movement::Hold => Moved {
                direction: "hold",
                why: None,
                tier: None,
                headroom: None,
            },
            Movement::Down => moved("down", "every protected tier has headroom above relax_above"),
            Movement::Calm => moved(
                "down",
                "vLLM queues nothing and the cache is below shape_pressure_at",
            ),
            Movement::Idle => moved(
                "down",
                "idle: nothing queued and KV-cache usage below idle_pressure_below for idle_release_ms",
            ),
            Movement::Up { tier, headroom } => Moved {
                direction: "up",
                why: Some(format!(
                    "{} headroom {headroom:.2} below escalate_below",
                    tier.as_str()
                )),
                tier: Some(tier.as_str()),
                headroom: Some(headroom),
            },
            Movement::Rail(kind) => moved(
                "rail",
                match kind {
                    RailKind::Pressure => "KV-cache usage at rail_pressure_at",
                    RailKind::QueueDepth => "vLLM waiting queue at rail_queue_depth_at",
                },
            ),
            Movement::Shape => moved(
                "up",
                "KV-cache usage at shape_pressure_at: every cap and brownout in force",
            ),
        }
    }
}

/// Which source feeds the signals, the Prometheus poller's last round when it runs, and the
/// trace exporter (`telemetry.tracing`).
#[derive(Debug, Serialize)]
pub struct Telemetry {
    pub source: &'static str,
    pub prometheus: Option<PrometheusStatus>,
    pub tracing: sluice_trace::TracingStatus,
}
