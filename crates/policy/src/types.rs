use std::fmt;

/// Milliseconds on a caller-owned monotonic clock.
pub type Millis = u64;

/// A tenant's service tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Guaranteed,
    Standard,
    BestEffort,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Guaranteed, Tier::Standard, Tier::BestEffort];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Guaranteed => "Guaranteed",
            Tier::Standard => "Standard",
            Tier::BestEffort => "Best-Effort",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// Accepts the seed's spelling (`Best-Effort`) and the common variants users type.
    pub fn parse(s: &str) -> Option<Tier> {
        match s
            .trim()
            .to_ascii_lowercase()
            .replace(['_', ' '], "-")
            .as_str()
        {
            "guaranteed" => Some(Tier::Guaranteed),
            "standard" => Some(Tier::Standard),
            "best-effort" | "besteffort" => Some(Tier::BestEffort),
            _ => None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Severity of load as seen by one tier (each tier has its own thresholds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum PressureState {
    #[default]
    Normal,
    Elevated,
    Critical,
}

impl PressureState {
    pub fn as_str(self) -> &'static str {
        match self {
            PressureState::Normal => "Normal",
            PressureState::Elevated => "Elevated",
            PressureState::Critical => "Critical",
        }
    }

    /// Stable numeric form for gauges: 0 Normal, 1 Elevated, 2 Critical.
    pub fn level(self) -> i64 {
        self as i64
    }
}

/// Which signal pushed a tier into its current state; it names the reason code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SignalKind {
    Pressure,
    QueueDepth,
    SlaViolationRate,
}

impl SignalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SignalKind::Pressure => "pressure",
            SignalKind::QueueDepth => "queue_depth",
            SignalKind::SlaViolationRate => "sla_violation_rate",
        }
    }
}

/// The values the policy sees for one pool; `None` means unavailable (never a stale value).
/// Pressure is KV-cache usage in percent (0–100), queue depth is vLLM's waiting requests, the SLA
/// violation rate is a fraction (0–1) of completed requests that missed their tier's target.
/// The delays are vLLM's own means over the last sample interval (from its histograms), used by
/// the adaptive controller only.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolSignals {
    pub pressure: Option<f64>,
    pub queue_depth: Option<f64>,
    pub sla_violation_rate: Option<f64>,
    /// Mean of `vllm:request_queue_time_seconds` over the interval, in ms.
    pub queue_time_ms: Option<f64>,
    /// Mean of `vllm:time_to_first_token_seconds` over the interval, in ms.
    pub ttft_ms: Option<f64>,
    /// Mean of `vllm:inter_token_latency_seconds` over the interval, in ms: the pool's pace.
    pub itl_ms: Option<f64>,
    /// Sluice's own estimated work in flight on the pool (KV tokens), adaptive mode's gate.
    pub inflight_work: Option<f64>,
}

/// One tier's evaluated state after stabilisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierState {
    pub tier: Tier,
    pub state: PressureState,
    /// The signal behind the last escalation (names the reason code).
    pub driver: SignalKind,
    /// Every signal is unavailable: the policy fails open.
    pub fail_open: bool,
    pub pressure_unavailable: bool,
}

/// What the policy needs to know about one request (nothing HTTP-specific).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestFacts {
    pub tier: Tier,
    /// POST/PUT/PATCH to a completions endpoint.
    pub shapeable: bool,
    /// A fallback model is configured and its backend is healthy.
    pub fallback_available: bool,
    /// The spot pool has at least one healthy backend.
    pub spot_healthy: bool,
    /// The pool whose backends also serve the fallback model, if any: in adaptive mode a
    /// saturated pool takes no fallback traffic.
    pub fallback_pool: Option<Pool>,
    /// Picks the request's place within a tier's share (adaptive mode sheds, moves or caps a
    /// share of a tier): the same ticket always gets the same answer.
    pub ticket: u64,
    /// Estimated prompt tokens and the requested completion budget (adaptive mode's work gate).
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    /// Work in flight now on on-demand and spot (by [`Pool::signal_index`]).
    pub inflight_work: [f64; 2],
}

#[cfg(test)]
impl RequestFacts {
    /// A completion of `tier` in a healthy fleet with a fallback and nothing in flight: the
    /// request the policy's tests vary one field of.
    pub(crate) fn of(tier: Tier) -> Self {
        RequestFacts {
            tier,
            shapeable: true,
            fallback_available: true,
            spot_healthy: true,
            fallback_pool: None,
            ticket: 0,
            prompt_tokens: 0,
            max_tokens: None,
            inflight_work: [0.0; 2],
        }
    }
}

/// The intervention applied to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Pass,
    /// Cap `max_tokens` / `max_completion_tokens`.
    Degrade {
        max_tokens: u32,
    },
    /// Rewrite `model` to the configured fallback (and keep any cap the state calls for).
    Fallback {
        max_tokens: Option<u32>,
    },
    Reject,
}

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Action::Pass => "pass",
            Action::Degrade { .. } => "degrade",
            Action::Fallback { .. } => "fallback",
            Action::Reject => "reject",
        }
    }

    pub fn max_tokens_cap(&self) -> Option<u32> {
        match self {
            Action::Degrade { max_tokens } => Some(*max_tokens),
            Action::Fallback { max_tokens } => *max_tokens,
            _ => None,
        }
    }
}

/// A QoS pool. Routing between them is a service decision, never load balancing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    OnDemand,
    Spot,
    /// The fallback model's backend.
    Fallback,
}

impl Pool {
    /// The pool whose signals and admission control apply: the fallback backend's traffic is
    /// judged where it runs, which the caller knows (see [`RequestFacts::fallback_pool`]).
    pub fn signal_index(self) -> Option<usize> {
        match self {
            Pool::OnDemand => Some(0),
            Pool::Spot => Some(1),
            Pool::Fallback => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Pool::OnDemand => "on-demand",
            Pool::Spot => "spot",
            Pool::Fallback => "fallback",
        }
    }
}

/// How tiers are governed: `thresholds` is the prototype's static per-tier thresholds on the
/// on-demand pool's signals; `adaptive` is SLO feedback per pool ([`crate::adaptive`]) with the
/// KV thresholds kept only as hard rails and as the point where shaping (never shedding)
/// starts at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyMode {
    Thresholds,
    #[default]
    Adaptive,
}

impl PolicyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyMode::Thresholds => "thresholds",
            PolicyMode::Adaptive => "adaptive",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "thresholds" => Some(PolicyMode::Thresholds),
            "adaptive" => Some(PolicyMode::Adaptive),
            _ => None,
        }
    }
}
