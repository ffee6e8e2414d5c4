//! The policy's knobs, in their own module because both the rules ([`crate::tenant_policy`])
//! and the models they tune ([`crate::adaptive`], [`crate::stability`], [`crate::pressure`])
//! name them.

use crate::types::Millis;

/// Defaults are the seed's: SLUICE_STATE_CONSECUTIVE_SAMPLES=2, SLUICE_STATE_COOLDOWN_SECONDS=2,
/// SLUICE_STATE_HYSTERESIS=5 (percentage points of KV pressure).
#[derive(Debug, Clone, PartialEq)]
pub struct StabilityTuning {
    pub consecutive_samples: u32,
    pub cooldown_ms: Millis,
    /// Band for KV pressure, in percentage points.
    pub hysteresis: f64,
    /// Band for vLLM's waiting-queue depth, in requests.
    pub queue_depth_hysteresis: f64,
    /// Band for the SLA-violation rate, as a fraction.
    pub sla_rate_hysteresis: f64,
}

impl Default for StabilityTuning {
    fn default() -> Self {
        Self {
            consecutive_samples: 2,
            cooldown_ms: 2000,
            hysteresis: 5.0,
            queue_depth_hysteresis: 2.0,
            sla_rate_hysteresis: 0.05,
        }
    }
}

/// Knobs of the controller. The defaults are the shipped ones (`policy.adaptive.*`, read by
/// the config loader straight into this struct).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveTuning {
    /// Outcomes older than this no longer count.
    pub window_ms: Millis,
    /// The latency quantile compared with each tier's target.
    pub quantile: f64,
    /// Completions a tier needs in the window before its own latency counts.
    pub min_samples: usize,
    /// Raise the level while the protected headroom is below this.
    pub escalate_below: f64,
    /// Lower it only while the headroom is at least this (the gap is the hysteresis band).
    pub relax_above: f64,
    /// Largest and smallest rise per sample, in ladder steps; the rise grows with the shortfall.
    pub max_step_up: f64,
    pub min_step_up: f64,
    /// Fall per sample while relaxed (additive: recover slowly, shed fast).
    pub step_down: f64,
    /// No fall for this long after a rise: the outcomes of the new level need time to arrive.
    pub hold_ms: Millis,
    /// Hard rails on the pool's own signals: at or above them every non-Guaranteed tier is shed
    /// at once, whatever the latencies say.
    pub rail_pressure_at: Option<f64>,
    pub rail_queue_depth_at: Option<f64>,
    /// At or above this KV usage every shaping step (caps, brownout) is in force at once: a
    /// nearly full cache makes the latencies the controller waits for late, and shaping costs
    /// tokens, never a refusal.
    pub shape_pressure_at: Option<f64>,
    /// At or above this KV usage a tier that may fall back is moved to the fallback whenever
    /// the fallback runs on other capacity that is below it and not short itself: the cache
    /// fills in seconds and what is admitted then holds it for its whole answer, so the next
    /// Guaranteed burst would wait for it; the level still acts on the latencies as before.
    /// `None`: off.
    pub fallback_pressure_at: Option<f64>,
    /// While Guaranteed's pool is busy (vLLM queues, the cache is at or above
    /// `idle_pressure_below`, or the batch eats a TPOT budget) and Guaranteed's TTFT target
    /// there is tight, a tier that may fall back does not start on it: it goes to the fallback
    /// while the fallback's pool is calm (level 0, below `fallback_pressure_at`), else it is
    /// refused. What a lower tier starts holds the cache for its whole answer, and Guaranteed's
    /// first tokens then wait for it in spikes its headroom gives no warning of
    /// (bench/results/frontier.md). `None`: on wherever `fallback_pressure_at` is set; `true`
    /// without it is a config error.
    pub reserve_guaranteed_pool: Option<bool>,
    /// Guaranteed's TTFT target is tight while under this many times its learned unloaded TTFT
    /// on the pool (or while that is not learned yet): a looser one absorbs the wait for a
    /// running answer to free the cache, and reserving there only costs the lower tiers.
    /// `None`: always tight. Only a TTFT objective is reserved for.
    pub reserve_ttft_below_x: Option<f64>,
    /// While Guaranteed's pool is busy (as `reserve_guaranteed_pool` reads it), a Guaranteed
    /// request goes to its model's spot pool when that pool is healthy and calm (level 0, not
    /// busy) and has room to lend for it (its lend limit): the two batches then share
    /// Guaranteed's arrivals and each decodes faster than one alone. Spot capacity may be
    /// reclaimed, and an answer running there then is lost (a retry covers only what failed
    /// before its first byte): a fleet whose spot goes without notice turns this off.
    pub guaranteed_overflow_to_spot: bool,
    /// Gate lower tiers on the work in flight per pool ([`super::work_gate`]).
    pub work_gate: bool,
    /// Shares of a pool's learned work limit Standard and Best-Effort may fill.
    pub work_share_standard: f64,
    pub work_share_best_effort: f64,
    /// Completion tokens counted for a request that sets no `max_tokens`.
    pub assumed_max_tokens: u64,
    /// Rise per unit of headroom shortfall, in ladder steps (then bounded by the step sizes).
    pub rise_gain: f64,
    /// Count requests still running at their age so far (the leading reading).
    pub lead: bool,
    /// A pool is idle while nothing waits in vLLM and its KV usage is below this; after
    /// `idle_release_ms` of it the level is 0 whatever the latencies say. `None`: never idle.
    /// 1.5 s of samples is at most 2 s of the fleet's own time at the shipped 500 ms scrape:
    /// the idle stretch may have begun just after the previous scrape.
    pub idle_pressure_below: Option<f64>,
    pub idle_release_ms: Millis,
    /// How slowly a tier's learned unloaded latency may rise (see [`Baseline`]).
    pub baseline_half_life_ms: Millis,
    /// Samples ahead that Guaranteed's reading projects vLLM's queue delay by its growth.
    pub queue_lookahead_samples: f64,
}

impl AdaptiveTuning {
    /// `reserve_guaranteed_pool` in force: as set, else wherever the fill mark is.
    pub fn reserves_guaranteed_pool(&self) -> bool {
        self.reserve_guaranteed_pool
            .unwrap_or(self.fallback_pressure_at.is_some())
    }
}

impl Default for AdaptiveTuning {
    fn default() -> Self {
        Self {
            window_ms: 3000,
            quantile: 0.9,
            min_samples: 4,
            escalate_below: 0.3,
            relax_above: 0.45,
            max_step_up: 2.0,
            min_step_up: 0.25,
            step_down: 0.25,
            hold_ms: 1500,
            rail_pressure_at: Some(100.0),
            rail_queue_depth_at: Some(128.0),
            shape_pressure_at: Some(90.0),
            fallback_pressure_at: Some(70.0),
            reserve_guaranteed_pool: None,
            reserve_ttft_below_x: Some(5.0),
            guaranteed_overflow_to_spot: true,
            work_gate: false,
            work_share_standard: 0.9,
            work_share_best_effort: 0.7,
            assumed_max_tokens: 1024,
            rise_gain: 3.0,
            lead: true,
            idle_pressure_below: Some(50.0),
            idle_release_ms: 1500,
            baseline_half_life_ms: 30_000,
            queue_lookahead_samples: 2.0,
        }
    }
}
