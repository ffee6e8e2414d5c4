//! The event model both engines produce: one [`RequestRecord`] per request and a timeline of
//! [`Sample`]s. The in-process model and the live HTTP run fill the same structs, so one report
//! (and one plot) reads either.

use serde::Serialize;
use sluice_policy::slo::{judge, Dim, Judged, Measured, Slo};
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
    /// `direct` on engines running vLLM's priority policy (`--scheduling-policy priority`),
    /// each request sending its tier as `priority`: what vLLM's own scheduler gives the tiers
    /// without Sluice.
    Priority,
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
    pub const ALL: [Mode; 7] = [
        Mode::Baseline,
        Mode::Direct,
        Mode::Priority,
        Mode::Phase1,
        Mode::Phase2,
        Mode::Adaptive,
        Mode::Fifo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Baseline => "baseline",
            Mode::Direct => "direct",
            Mode::Priority => "priority",
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
    /// A completed stream's time per output token after the first: (last token − first) ÷
    /// (completion tokens − 1); `None` when not streamed, not completed or under two tokens.
    pub tpot_ms: Option<f64>,
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
            tpot_ms: None,
            stream: a.stream,
            answer_tokens: a.answer_tokens(a.max_tokens),
            completion_tokens: 0,
            decision: String::new(),
            reason: String::new(),
            pool: String::new(),
            queue_wait_ms: None,
        }
    }

    /// What was measured of it, as Sluice's own judgement of an objective reads it.
    pub fn measured(&self) -> Measured {
        Measured {
            latency_ms: self.latency_ms,
            ttft_ms: self.ttft_ms,
            tpot_ms: self.tpot_ms,
            completion_tokens: Some(self.completion_tokens),
            stream: self.stream,
        }
    }

    /// How it fared against `slo` (Sluice's own [`judge`]); `None` when it was not served: a
    /// refusal, an error or a timeout meets no dimension.
    pub fn judged(&self, slo: &Slo) -> Option<Judged> {
        self.completed().then(|| judge(slo, &self.measured()))
    }

    /// Served and within every dimension of `slo`.
    pub fn met(&self, slo: &Slo) -> bool {
        self.judged(slo).is_some_and(|j| j.met())
    }

    /// Served and within dimension `d` of `slo` (a dimension not set is met by any answer).
    pub fn met_dim(&self, slo: &Slo, d: Dim) -> bool {
        self.judged(slo).is_some_and(|j| !j.missed[d.index()])
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

    /// Moved to the fallback model: the model names the pool `fallback`; live, Sluice's
    /// `x-sluice-pool` names the pool that serves the fallback model (`spot`), where of
    /// Standard only a moved request runs (Guaranteed, never moved, runs there with its own
    /// model under `guaranteed_overflow_to_spot`).
    pub fn fallback(&self) -> bool {
        self.pool == "fallback"
            || self.decision == "fallback"
            || (self.pool == "spot" && self.tier == Tier::Standard)
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
    /// Each pool's decode pace now and unloaded (ms a token), where the engine says (the model).
    pub pace: Option<[(f64, f64); 2]>,
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
    /// Each tier's objective (by [`Tier::index`]): the scenario's TTFT and TPOT targets, or
    /// its end-to-end target alone.
    #[serde(serialize_with = "ser_slos")]
    pub slo: [Slo; 3],
    /// Sluice's peak resident memory over the run, KiB.
    pub sluice_rss_kib: Option<u64>,
    /// Anything the reader should know about how this run went (e.g. a signal source).
    pub notes: Vec<String>,
}

fn ser_slos<S: serde::Serializer>(v: &[Slo; 3], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(
        |o| serde_json::json!({"ttft_ms": o.ttft_ms, "tpot_ms": o.tpot_ms, "e2e_ms": o.e2e_ms}),
    ))
}

/// An objective as a report prints it: `TTFT 45 / TPOT 2 ms`, or `e2e 2000 ms`.
pub fn slo_label(o: &Slo) -> String {
    let parts: Vec<String> = o
        .dims()
        .map(|d| {
            let name = match d {
                Dim::Ttft => "TTFT",
                Dim::Tpot => "TPOT",
                Dim::E2e => "e2e",
            };
            format!("{name} {}", o.get(d).unwrap_or(0))
        })
        .collect();
    format!("{} ms", parts.join(" / "))
}

/// Whether any tier's objective is in TTFT / TPOT terms (the per-dimension tables apply).
pub fn per_dimension(slo: &[Slo; 3]) -> bool {
    slo.iter()
        .any(|o| o.ttft_ms.is_some() || o.tpot_ms.is_some())
}
