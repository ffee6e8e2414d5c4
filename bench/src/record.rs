//! The event model both engines produce: one [`RequestRecord`] per request and a timeline of
//! [`Sample`]s. The in-process model and the live HTTP run fill the same structs, so one report
//! (and one plot) reads either.

use serde::Serialize;
use sluice_policy::{PressureState, Tier};

use crate::scenario::{ser_tier, Arrival};

/// How a run routes requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Only the Guaranteed arrivals, straight to the backend: the "backend unloaded" yardstick.
    Baseline,
    /// Clients straight to the simulators (each tier to its pool's backend).
    Direct,
    /// Sluice with the KV-pressure signal only and the shipped pressure thresholds: no
    /// queue-depth or SLA-rate thresholds, no capacities, queue, fallback or spot eviction.
    Phase1,
    /// Sluice with every signal, capacities, the queue, fallback and routing, in thresholds
    /// mode with the scenario's tuned knobs.
    Phase2,
    /// Sluice exactly as shipped (`conf/sluice.yaml`: adaptive mode, its defaults), with only
    /// the addresses, tenants and SLA targets of the scenario.
    Adaptive,
    /// `adaptive` with `queue.fair_share: false`: the tier queue in plain arrival order, the
    /// yardstick of the fair share between tenants.
    Fifo,
}

impl Mode {
    pub const ALL: [Mode; 6] = [
        Mode::Baseline,
        Mode::Direct,
        Mode::Phase1,
        Mode::Phase2,
        Mode::Adaptive,
        Mode::Fifo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Baseline => "baseline",
            Mode::Direct => "direct",
            Mode::Phase1 => "phase1",
            Mode::Phase2 => "phase2",
            Mode::Adaptive => "adaptive",
            Mode::Fifo => "fifo",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.as_str() == s)
    }

    pub fn uses_sluice(self) -> bool {
        matches!(
            self,
            Mode::Phase1 | Mode::Phase2 | Mode::Adaptive | Mode::Fifo
        )
    }
}

/// What happened to one request, as the client saw it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub id: usize,
    pub tenant: String,
    #[serde(serialize_with = "ser_tier")]
    pub tier: Tier,
    /// Scheduled arrival, ms from the run's start.
    pub at_ms: u64,
    /// How late the request was actually sent (client scheduling lag).
    pub send_lag_ms: f64,
    /// Status 0 means no response (timeout or connection failure).
    pub status: u16,
    /// Arrival → last byte.
    pub latency_ms: f64,
    /// Arrival → first streamed token; `None` when not streamed or not completed.
    pub ttft_ms: Option<f64>,
    pub stream: bool,
    /// The completion the request gets uncapped: `max_tokens`, or where the engine model ends
    /// the answer on its own before it.
    pub answer_tokens: u64,
    pub completion_tokens: u64,
    /// `x-sluice-decision` (`direct` when there is no proxy).
    pub decision: String,
    pub reason: String,
    /// `x-sluice-pool`, or the pool the client itself chose.
    pub pool: String,
    pub queue_wait_ms: Option<f64>,
}

impl RequestRecord {
    /// The record of an arrival before anything has answered it (status 0: no response).
    pub fn pending(a: &Arrival) -> Self {
        Self {
            id: a.id,
            tenant: a.tenant.clone(),
            tier: a.tier,
            at_ms: a.at_ms,
            send_lag_ms: 0.0,
            status: 0,
            latency_ms: 0.0,
            ttft_ms: None,
            stream: a.stream,
            answer_tokens: a.answer_tokens(a.max_tokens),
            completion_tokens: 0,
            decision: String::new(),
            reason: String::new(),
            pool: String::new(),
            queue_wait_ms: None,
        }
    }

    pub fn completed(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn rejected(&self) -> bool {
        self.status == 429
    }

    /// Capped by Sluice: fewer tokens than the answer has uncapped (the simulator generates
    /// exactly that many, so any shortfall is the rewrite).
    pub fn degraded(&self) -> bool {
        self.completed() && self.completion_tokens < self.answer_tokens
    }

    pub fn queued(&self) -> bool {
        self.queue_wait_ms.is_some() || self.decision == "queue"
    }

    pub fn fallback(&self) -> bool {
        self.pool == "fallback"
    }
}

/// One look at the system, taken every sampling interval.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    pub t_ms: u64,
    /// On-demand KV usage reported by its simulator, percent.
    pub kv_on_demand: Option<f64>,
    pub kv_spot: Option<f64>,
    pub waiting_on_demand: Option<f64>,
    pub waiting_spot: Option<f64>,
    /// The pressure the policy used (scraped or forced), percent; Sluice runs only.
    pub policy_pressure: Option<f64>,
    /// Tier states by [`Tier::index`]; Sluice runs only.
    #[serde(serialize_with = "ser_states")]
    pub states: Option<[PressureState; 3]>,
    pub fallback_active: Option<bool>,
    pub inflight: Option<[u64; 3]>,
    pub queued: Option<[u64; 3]>,
    /// Adaptive mode: the admission level of each pool (on-demand, spot).
    pub levels: Option<[f64; 2]>,
    /// Adaptive mode: each pool's policy saw its KV at the shaping floor at its last sample.
    pub shaping: Option<[bool; 2]>,
}

fn ser_states<S: serde::Serializer>(
    v: &Option<[PressureState; 3]>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match v {
        Some(st) => s.collect_seq(st.iter().map(|x| x.as_str())),
        None => s.serialize_none(),
    }
}

/// Quantiles of a Prometheus histogram.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct HistQuantiles {
    pub count: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Everything one (scenario, mode, engine) run produced.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub scenario: String,
    pub mode: Mode,
    /// `live` (real HTTP) or `model` (in-process, simulated time).
    pub engine: &'static str,
    pub duration_s: f64,
    pub records: Vec<RequestRecord>,
    pub samples: Vec<Sample>,
    /// From `sluice_proxy_overhead_seconds`; live Sluice runs only.
    pub overhead: Option<HistQuantiles>,
    /// The stability cooldown the run used, for the flapping count.
    pub cooldown_ms: u64,
    pub recovery_marker_ms: Option<u64>,
    pub sla_ms: [u64; 3],
    /// Sluice's peak resident memory over the run, KiB.
    pub sluice_rss_kib: Option<u64>,
    /// Anything the reader should know about how this run went (e.g. a signal source).
    pub notes: Vec<String>,
}
