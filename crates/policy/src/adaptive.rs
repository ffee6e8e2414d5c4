//! SLO-feedback admission (`policy.mode: adaptive`): each pool keeps an *admission level* over a
//! ladder of interventions, raised when the tiers it protects lose latency headroom against
//! their SLA targets and lowered, slowly, when the headroom comes back. KV-cache thresholds only
//! stay as hard rails, and as the point (`shape_pressure_at`) where every shaping step applies
//! at once: shaping costs tokens, never a refusal. The idea is DAGOR's (admission level over
//! business priority driven by measured queuing delay) with the seed's tiers as the priorities.
//!
//! The ladder ([`ladder`]) orders what may be done to a pool's traffic, cheapest first:
//! 1. cap `max_tokens` of the non-Guaranteed tiers, lowest tier first: a capped request is still
//!    served, and a shorter generation frees KV sooner for everyone;
//! 2. cap them deeper where a tier has a brownout cap, lowest first: a short answer in time is
//!    worth more than a 429, and it keeps the load on the tier's own pool (moving it would
//!    slow the tiers of the pool it moves to);
//! 3. move a fallback-eligible tier to the fallback model (other capacity), lowest first;
//! 4. shed the non-Guaranteed tiers, lowest first;
//! 5. cap Guaranteed last. Guaranteed is never shed by the controller, only by a hard rail.
//!
//! The level is a real number: level 2.4 means steps 0 and 1 apply to all of their tier's
//! requests and step 2 to 40 % of them (picked by the request's ticket, so deterministically).
//! A step moves on the headroom of the tiers it protects: a cap or fallback step on its own tier
//! and those above it, a shed step only on the tiers strictly above (a tier is never shed to
//! rescue its own latency: that would turn its late answers into refusals and help nobody).
//!
//! Headroom of a tier on a pool = 1 − (observed latency quantile / SLA target), taking the
//! worse of Sluice's own end-to-end latencies over a short window and vLLM's queue delay on
//! that pool. Everything here is pure: outcomes and signals come in with their times.

use crate::ceiling::{self, PaceFit};
use crate::slo::{Dim, Slo};
use crate::tenant_policy::{FallbackCapacity, PolicyRules};
pub use crate::tuning::AdaptiveTuning;
use crate::types::{Millis, Pool, PoolSignals, Tier};
use crate::work_gate::WorkLimit;
use std::collections::VecDeque;

/// What a ladder step does to its tier's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    Cap,
    Fallback,
    /// The tier's deeper cap (brownout), after every cap step.
    Brownout,
    Shed,
}

impl StepKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Cap => "cap",
            StepKind::Fallback => "fallback",
            StepKind::Brownout => "brownout",
            StepKind::Shed => "shed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub tier: Tier,
    pub kind: StepKind,
}

/// Higher is more important: Guaranteed 2, Standard 1, Best-Effort 0.
fn rank(t: Tier) -> usize {
    2 - t.index()
}

/// Lowest tier first.
const BY_RANK: [Tier; 3] = [Tier::BestEffort, Tier::Standard, Tier::Guaranteed];

/// The interventions of `rules` on `pool`'s traffic, cheapest first (see the module doc). A
/// fallback step is there only when the fallback runs on other capacity than `pool`'s.
pub fn ladder(rules: &PolicyRules, pool: Pool) -> Vec<Step> {
    ladder_with(rules, rules.fallback_relieves(pool))
}

/// The ladder of a pool for which moving traffic to the fallback model does (`fallback`) or
/// does not relieve it.
pub fn ladder_with(rules: &PolicyRules, fallback: bool) -> Vec<Step> {
    let lower = || BY_RANK.into_iter().filter(|t| *t != Tier::Guaranteed);
    let mut steps = Vec::new();
    let step = |tier, kind| Step { tier, kind };
    steps.extend(
        lower()
            .filter(|t| rules.tier(*t).max_tokens_cap.is_some())
            .map(|t| step(t, StepKind::Cap)),
    );
    steps.extend(
        lower()
            .filter(|t| rules.tier(*t).brownout_max_tokens.is_some())
            .map(|t| step(t, StepKind::Brownout)),
    );
    steps.extend(
        lower()
            .filter(|t| fallback && rules.tier(*t).fallback_eligible)
            .map(|t| step(t, StepKind::Fallback)),
    );
    steps.extend(lower().map(|t| step(t, StepKind::Shed)));
    let g = rules.tier(Tier::Guaranteed);
    if g.max_tokens_cap.is_some() {
        steps.push(step(Tier::Guaranteed, StepKind::Cap));
    }
    if fallback && g.fallback_eligible {
        steps.push(step(Tier::Guaranteed, StepKind::Fallback));
    }
    steps
}

/// Where the level rests once every shaping step (cap, brownout) is in force: the end of the
/// ladder's leading run of shaping steps.
pub fn shape_floor(steps: &[Step]) -> f64 {
    steps
        .iter()
        .position(|s| !matches!(s.kind, StepKind::Cap | StepKind::Brownout))
        .unwrap_or(steps.len()) as f64
}

/// Where the level rests when a rail trips: every shed step fully applied.
pub fn rail_level(steps: &[Step]) -> f64 {
    steps
        .iter()
        .rposition(|s| s.kind == StepKind::Shed)
        .map_or(0.0, |i| (i + 1) as f64)
}

/// What the controller hears of one request: its arrival when the policy decides it (so a tier
/// counts as present on a pool from its first request, and a fully shed tier is not mistaken
/// for an absent one), then its end if it was served.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub at: Millis,
    pub tier: Tier,
    /// End-to-end latency of a served request; `None` for the arrival.
    pub latency_ms: Option<f64>,
    /// A streamed request's time to first token; for one still running, when its first token
    /// came (`None` while it has not).
    pub ttft_ms: Option<f64>,
    /// A streamed request's time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// Completion tokens of a served request, when its usage was read.
    pub tokens: Option<u64>,
    pub stream: bool,
    /// A stream's first token, reported when it comes (`latency_ms` = `ttft_ms`): the TTFT of a
    /// long answer is news then, not when the answer ends. Its end then carries no TTFT.
    pub first_token: bool,
    /// The request failed (5xx, timeout): counted as a missed target.
    pub failed: bool,
    /// A request still outstanding at `at` (sent to the pool, not yet answered), reported at
    /// every sample while it runs: `latency_ms` is its age so far, a lower bound on its
    /// latency that is known before it ends. Counted for this sample only, never remembered.
    pub pending: bool,
}

impl Outcome {
    /// A request decided at `at` (it counts as traffic of `tier` on the pool).
    pub fn arrival(at: Millis, tier: Tier) -> Self {
        Outcome {
            at,
            tier,
            latency_ms: None,
            ttft_ms: None,
            tpot_ms: None,
            tokens: None,
            stream: false,
            first_token: false,
            failed: false,
            pending: false,
        }
    }

    /// When the request arrived: its end (or first token) less its latency so far.
    fn started(&self) -> Millis {
        self.at
            .saturating_sub(self.latency_ms.unwrap_or(0.0) as Millis)
    }

    /// A stream's first token reached the client at `at`, `ttft_ms` after the request arrived.
    pub fn first_token(at: Millis, tier: Tier, ttft_ms: f64) -> Self {
        Outcome {
            first_token: true,
            ..Self::served(at, tier, ttft_ms).streamed(Some(ttft_ms), None)
        }
    }

    /// A request served in `latency_ms`, ending at `at`.
    pub fn served(at: Millis, tier: Tier, latency_ms: f64) -> Self {
        Outcome {
            latency_ms: Some(latency_ms),
            ..Self::arrival(at, tier)
        }
    }

    /// A request that failed (5xx, timeout), ending at `at`: a missed target.
    pub fn failed(at: Millis, tier: Tier) -> Self {
        Outcome {
            failed: true,
            ..Self::arrival(at, tier)
        }
    }

    /// A request still running at `at`, `age_ms` after it arrived.
    pub fn pending(at: Millis, tier: Tier, age_ms: f64) -> Self {
        Outcome {
            pending: true,
            ..Self::served(at, tier, age_ms)
        }
    }

    /// The same request, streamed: its first token at `ttft_ms` (for a running one, `None`
    /// until it came) and its pace after it.
    pub fn streamed(self, ttft_ms: Option<f64>, tpot_ms: Option<f64>) -> Self {
        Outcome {
            stream: true,
            ttft_ms,
            tpot_ms,
            ..self
        }
    }

    /// The same request with its completion tokens counted.
    pub fn with_tokens(self, tokens: Option<u64>) -> Self {
        Outcome { tokens, ..self }
    }

    /// This request's reading on each dimension of `slo`, as a share of its target (by
    /// [`Dim::index`]; `None` where the dimension is not set or says nothing of it). A running
    /// request counts at its age on the dimensions its age bounds.
    fn ratios(&self, slo: &Slo) -> [Option<f64>; 3] {
        if self.failed {
            return Dim::ALL.map(|d| slo.get(d).map(|_| f64::INFINITY));
        }
        let Some(latency) = self.latency_ms else {
            return [None; 3];
        };
        let per = |d: Dim, v: Option<f64>| v.zip(slo.get(d)).map(|(v, t)| v / t.max(1) as f64);
        if self.first_token {
            return [per(Dim::Ttft, self.ttft_ms), None, None];
        }
        // A running stream bounds its first token by its age until the token comes (then it
        // was reported on its own); a finished one's came as its own outcome, or here.
        let ttft = if self.stream && self.pending {
            Some(latency).filter(|_| self.ttft_ms.is_none())
        } else if self.stream {
            self.ttft_ms
        } else {
            // A whole answer's first token is not seen: its wait is vLLM's queue delay, which
            // the TTFT reading adds anyway, and its pace is vLLM's. (Read back from the deadline
            // it would be the wait plus the pace's slack against the target, which a loose TPOT
            // target turns into 0 and a tier of whole answers into an unloaded TTFT of 0.)
            None
        };
        let tpot = self.tpot_ms.filter(|_| self.stream && !self.pending);
        [
            per(Dim::Ttft, ttft),
            per(Dim::Tpot, tpot),
            per(Dim::E2e, Some(latency)),
        ]
    }
}

/// Why the level last moved, for `/status` and the decision trail.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Movement {
    Hold,
    /// Raised because `tier`'s headroom was `headroom`.
    Up {
        tier: Tier,
        headroom: f64,
    },
    /// Lowered: the protected headroom is back above `relax_above` (or unknown).
    Down,
    /// Lowered fast: vLLM queues nothing and the cache is below `shape_pressure_at`.
    Calm,
    /// Set to 0: the pool has been idle for `idle_release_ms`.
    Idle,
    /// A hard rail tripped.
    Rail(RailKind),
    /// KV usage reached `shape_pressure_at`: every shaping step put in force.
    Shape,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailKind {
    Pressure,
    QueueDepth,
}

/// A pool's admission control as published to the request path.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolControl {
    pub level: f64,
    pub steps: Vec<Step>,
    /// Per tier (by [`Tier::index`]): headroom on this pool, when known.
    pub headroom: [Option<f64>; 3],
    /// The tier's observed latency quantile over the window, when it has enough completions.
    pub latency_ms: [Option<f64>; 3],
    /// The same quantile over the requests admitted since the level last rose, counting the
    /// ones still running at their age so far: the leading reading.
    pub lead_ms: [Option<f64>; 3],
    /// vLLM's mean queue delay on this pool over the last sample, when exported.
    pub delay_ms: Option<f64>,
    pub rail: Option<RailKind>,
    /// KV usage is at `shape_pressure_at`: the shaping steps are held in force.
    pub shaping: bool,
    /// KV usage is at `fallback_pressure_at`: what may fall back leaves this pool for a fallback
    /// whose pool is not (`None`: the usage is unknown or the mark is off, and nothing moves).
    pub filling: Option<bool>,
    pub moved: Movement,
    /// Some served tier is short of headroom: this pool should not take fallback traffic.
    pub saturated: bool,
    /// The work limit (estimated KV tokens in flight) the gate applies while the level is up:
    /// the lower of the predicted ceiling ([`crate::ceiling`]) and, with `work_gate`, the limit
    /// learned once the pool has run short.
    pub work_limit: Option<f64>,
    /// Sluice's own work in flight on the pool at the sample.
    pub inflight_work: Option<f64>,
    /// The work in flight this pool may reach with answers from another pool's tiers (the
    /// fallback model, Guaranteed's overflow): where its cache would reach
    /// `idle_pressure_below` or its pace would spend half the tightest TPOT budget of the
    /// tiers it is home to. `None` while too little is known or in use to scale from.
    pub lend_limit: Option<f64>,
    /// Per tier: its learned unloaded latency on this pool (ms), once it has answered here.
    pub unloaded_ms: [Option<f64>; 3],
    /// Per tier: its unloaded latency is at or above its target, so no shedding can get it
    /// there; it never raises the level (reported, and warned about once).
    pub unattainable: [bool; 3],
    /// Per tier and dimension (by [`Tier::index`], [`Dim::index`]): its reading on this pool.
    pub dims: [[DimReading; 3]; 3],
    /// Nothing has queued in vLLM and its cache has stayed below `idle_pressure_below` for
    /// `idle_release_ms`: the level is 0 and stays there while this holds.
    pub idle: bool,
    /// At this sample vLLM queues, the cache is at or above `idle_pressure_below` or the
    /// batch's pace has spent half a tier's TPOT budget: the instant reading behind `idle`,
    /// without its `idle_release_ms` of hold (`reserve_guaranteed_pool` lends the pool as soon
    /// as it clears).
    pub busy: bool,
    /// The batch's pace has spent half a tier's TPOT budget here: a lower tier moved onto this
    /// pool would slow every answer it decodes.
    pub pace_busy: bool,
    /// vLLM's inter-token latency over the last sample (ms), when it exports it: the pace a
    /// request admitted now decodes at.
    pub pace_ms: Option<f64>,
}

impl PoolControl {
    pub fn idle(steps: Vec<Step>) -> Self {
        PoolControl {
            level: 0.0,
            steps,
            headroom: [None; 3],
            latency_ms: [None; 3],
            lead_ms: [None; 3],
            delay_ms: None,
            rail: None,
            shaping: false,
            filling: None,
            moved: Movement::Hold,
            saturated: false,
            work_limit: None,
            inflight_work: None,
            lend_limit: None,
            unloaded_ms: [None; 3],
            unattainable: [false; 3],
            dims: [[DimReading::default(); 3]; 3],
            idle: false,
            busy: true,
            pace_busy: false,
            pace_ms: None,
        }
    }

    /// How much of step `i` applies (0–1).
    fn fraction(&self, i: usize) -> f64 {
        (self.level - i as f64).clamp(0.0, 1.0)
    }

    /// The share of `tier`'s requests each kind of step applies to at the current level.
    pub fn shares(&self, tier: Tier) -> Shares {
        let mut s = Shares::default();
        for (i, step) in self.steps.iter().enumerate() {
            if step.tier != tier {
                continue;
            }
            let f = self.fraction(i);
            match step.kind {
                StepKind::Cap => s.cap = f,
                StepKind::Fallback => s.fallback = f,
                StepKind::Brownout => s.brownout = f,
                StepKind::Shed => s.shed = f,
            }
        }
        s
    }
}

/// One tier's reading on one dimension of its objective, for `/status` and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DimReading {
    pub target_ms: Option<u64>,
    /// The share of the dimension's budget still unspent (window reading, else the leading one).
    pub headroom: Option<f64>,
    /// The tier's quantile on this dimension over the window (ms).
    pub observed_ms: Option<f64>,
    /// The same over the requests since the last rise, running ones counted at their age.
    pub lead_ms: Option<f64>,
    /// Its learned unloaded value on this pool (ms).
    pub unloaded_ms: Option<f64>,
    /// The unloaded value is at or above the target: no admission decision can meet it.
    pub unattainable: bool,
    /// Share of the window's requests over the target on this dimension.
    pub missed: f64,
}

/// Per tier, one value of its first dimension in force (end to end, else TTFT, else TPOT):
/// the single-number fields `/status` has always shown.
fn primary(
    dims: &[[DimReading; 3]; 3],
    rules: &PolicyRules,
    get: impl Fn(&DimReading) -> Option<f64>,
) -> [Option<f64>; 3] {
    Tier::ALL.map(|t| {
        let slo = rules.tier(t).slo;
        [Dim::E2e, Dim::Ttft, Dim::Tpot]
            .into_iter()
            .find(|d| slo.get(*d).is_some())
            .and_then(|d| get(&dims[t.index()][d.index()]))
    })
}

/// Shares of one tier's requests that are capped, capped deeper (brownout), moved to the
/// fallback, shed. A request with ticket `u` (uniform in [0, 1)) is shed if `u < shed`, else
/// moved if `u < fallback`, and capped at the brownout cap if `u < brownout`, else at the cap
/// if `u < cap`: the steps nest, so a shed request would also have been capped and moved, and a
/// moved one keeps its caps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Shares {
    pub cap: f64,
    pub fallback: f64,
    pub brownout: f64,
    pub shed: f64,
}

/// One request as a window remembers it: (end, start, each dimension's reading as a share of
/// its target, `None` where it has none).
type Reading = (Millis, Millis, [Option<f64>; 3]);

/// The per-pool controller state carried from sample to sample.
#[derive(Debug, Clone)]
pub struct PoolController {
    level: f64,
    last_rise: Option<Millis>,
    /// When the level last rose: only requests that started after it are evidence about the
    /// level in force (older ones would push it up again for a load already shed). Falling
    /// keeps the evidence: answers that were good at a stricter level stay good news.
    last_change: Millis,
    /// Per tier: (end, start, each dimension's reading / target, `None` where it has none).
    recent: [VecDeque<Reading>; 3],
    work: WorkLimit,
    /// How this pool's decode pace grows with its cache, for the predicted work ceiling.
    pace_fit: PaceFit,
    /// Since when vLLM's waiting queue on this pool has been empty (none while it queues).
    drained_since: Option<Millis>,
    /// Since when the pool has been idle: nothing waiting in vLLM and KV usage below
    /// `idle_pressure_below`.
    idle_since: Option<Millis>,
    /// Per tier and dimension: its unloaded value on this pool in ms, a slowly moving minimum
    /// of its quantile ([`Baseline`]).
    baseline: [[Baseline; 3]; 3],
    /// Per tier, TTFT and TPOT: the last of its requests that ran start to end on an empty
    /// queue, whatever the window ([`Clean`]).
    clean: [[Clean; 3]; 3],
    last_sample: Option<Millis>,
    /// vLLM's queue delay at the previous sample, for its growth.
    last_delay: Option<f64>,
    /// When a TPOT shortage last raised the level, and vLLM's pace then.
    pace_rise: Option<(Millis, f64)>,
    /// Set in a fleet, where whether the fallback relieves this pool is known from where its
    /// model is served rather than from the rules' two-pool view.
    fallback_relieves: Option<bool>,
}

/// A tier's unloaded latency on one pool, learned the way TCP Vegas learns its base RTT: the
/// smallest latency quantile the tier has shown, taken at once when a window shows less, and
/// let up slowly (by `baseline_half_life_ms`) when windows show more, so that a fleet that
/// really got slower (longer prompts, another model) is followed. Only requests that started
/// while vLLM queued nothing are evidence of it: a fleet met while congested (Sluice started
/// during a peak) must not teach the congestion as its normal, and without vLLM's queue
/// signals nothing is learned and headroom is judged against the whole target.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Baseline {
    pub ms: Option<f64>,
}

impl Baseline {
    /// `clean`: the tier's latency quantile over requests that started with vLLM's queue
    /// empty (ms), when there are enough; `dt_ms` since the previous sample.
    fn learn(&mut self, clean: Option<f64>, dt_ms: Millis, half_life: Millis) {
        let Some(o) = clean else { return };
        self.ms = Some(match self.ms {
            Some(b) if o > b => {
                let k = 1.0 - 0.5f64.powf(dt_ms as f64 / half_life.max(1) as f64);
                b + (o - b) * k
            }
            _ => o,
        });
    }
}

/// The last [`CLEAN_KEPT`] values of one tier's dimension (ms) from requests that ran start to
/// end on an empty queue: the evidence a [`Baseline`] learns from when the window holds too few.
#[derive(Debug, Clone, Default)]
struct Clean {
    values: VecDeque<f64>,
    /// Some arrived since the baseline last took them.
    fresh: bool,
}

const CLEAN_KEPT: usize = 16;

impl Clean {
    fn push(&mut self, ms: f64) {
        if self.values.len() == CLEAN_KEPT {
            self.values.pop_front();
        }
        self.values.push_back(ms);
        self.fresh = true;
    }

    /// Their quantile, once for each batch of new ones (a baseline rises by each reading, so
    /// the same values read every sample would lift it as if seen again).
    fn take_quantile(&mut self, level: f64) -> Option<f64> {
        if !std::mem::take(&mut self.fresh) {
            return None;
        }
        quantile_of(
            self.values.iter().copied().collect(),
            level,
            BASELINE_MIN_SAMPLES,
        )
    }
}

/// The latency budget a tier has for queueing, as a share of its target: its target less its
/// unloaded latency, never below this (a tier whose unloaded latency is within a tenth of its
/// target is judged against the last tenth rather than against nothing).
const MIN_SLACK: f64 = 0.1;

/// After a pace-driven rise, the pace must be back to this share of what it was before the
/// next rise waits for it: a pace easing by more is the rise already working.
const PACE_EASING: f64 = 0.97;

/// How many times slower than the latencies' the learned unloaded pace lets up.
const PACE_HALF_LIVES: Millis = 10;

/// A calm level falling by thirds goes to 0 once below this.
const CALM_SNAP: f64 = 0.5;

/// Finished requests a window needs before its quantile can move a tier's baseline.
const BASELINE_MIN_SAMPLES: usize = 8;

/// Pace headroom under which the batch counts as busy: half of a tier's TPOT budget spent, the
/// mark under which "idle means open" still calls a pool idle. Shedding waits for
/// `escalate_below`; only lending Guaranteed's pool and moving onto a fallback stop here.
const BUSY_PACE_BELOW: f64 = 0.5;

/// Headroom under which a pool takes no fallback traffic.
const SATURATED_BELOW: f64 = 0.1;
/// Share of a served tier's requests over target (in the window) past which a pool takes no
/// fallback traffic: the fallback must not cost the pool's own tiers their SLA.
const SATURATED_MISSING: f64 = 0.01;

/// Bound on remembered outcomes per tier, so a flood cannot grow memory or the per-sample sort.
const RECENT_MAX: usize = 4096;

impl Default for PoolController {
    fn default() -> Self {
        Self::new()
    }
}

impl PoolController {
    pub fn new() -> Self {
        Self {
            level: 0.0,
            last_rise: None,
            last_change: 0,
            recent: Default::default(),
            work: WorkLimit::default(),
            pace_fit: PaceFit::default(),
            drained_since: None,
            idle_since: None,
            clean: Default::default(),
            baseline: Default::default(),
            last_sample: None,
            last_delay: None,
            pace_rise: None,
            fallback_relieves: None,
        }
    }

    /// Whether moving traffic to the fallback model relieves this pool (its ladder then has
    /// fallback steps), when the fleet knows it better than the rules do.
    pub fn set_fallback_relieves(&mut self, relieves: Option<bool>) {
        self.fallback_relieves = relieves;
    }

    pub fn level(&self) -> f64 {
        self.level
    }

    /// Feeds this sample's outcomes and signals of `pool`; returns the control to publish.
    pub fn observe(
        &mut self,
        pool: Pool,
        rules: &PolicyRules,
        tuning: &AdaptiveTuning,
        signals: &PoolSignals,
        outcomes: &[Outcome],
        now: Millis,
    ) -> PoolControl {
        // Requests still running, by tier: (start, age so far / target per dimension), this
        // sample only.
        let mut pending: [Vec<(Millis, [Option<f64>; 3])>; 3] = Default::default();
        for o in outcomes {
            let ratios = o.ratios(&rules.tier(o.tier).slo);
            let started = o.started();
            if o.pending {
                if o.latency_ms.is_some() {
                    pending[o.tier.index()].push((started, ratios));
                }
                continue;
            }
            let q = &mut self.recent[o.tier.index()];
            q.push_back((o.at, started, ratios));
            if q.len() > RECENT_MAX {
                q.pop_front();
            }
        }
        let horizon = now.saturating_sub(tuning.window_ms);
        for q in &mut self.recent {
            while q.front().is_some_and(|(at, _, _)| *at < horizon) {
                q.pop_front();
            }
        }
        let dt = self.last_sample.map_or(0, |t| now.saturating_sub(t));
        self.last_sample = Some(now);

        let steps = match self.fallback_relieves {
            Some(relieves) => ladder_with(rules, relieves),
            None => ladder(rules, pool),
        };
        // The wait a request arriving now meets. The histogram's interval mean is the past
        // interval's leavers: once vLLM's queue is empty it still reports the waits of the
        // backlog that just drained and would raise the level for a queue that is gone.
        let queue_empty = signals.queue_depth.is_some_and(|w| w <= 0.0);
        let delay_ms = signals
            .queue_time_ms
            .or(signals.ttft_ms)
            .filter(|v| v.is_finite())
            .map(|d| if queue_empty { 0.0 } else { d });
        // Guaranteed waits in vLLM's strict FCFS queue behind everything admitted before it,
        // and a level raised now relieves that queue only a sample or two later: so its reading
        // meets the delay a request arriving then will meet, the current one plus its growth
        // over the last sample for each sample of lookahead. Only Guaranteed's: the lower
        // tiers reading ahead too shed each other for no gain (bench/RESULTS.md).
        let growth = delay_ms
            .zip(self.last_delay)
            .map_or(0.0, |(d, before)| (d - before).max(0.0));
        self.last_delay = delay_ms;
        let g_delay_ms = delay_ms.map(|d| d + tuning.queue_lookahead_samples * growth);
        // Once vLLM queues nothing, the requests admitted since the rise speak for themselves:
        // the window's older answers describe a contention that is gone; and the requests
        // admitted since the queue emptied describe the level in force best of all.
        let no_queue = queue_empty && delay_ms.is_none_or(|d| d <= 0.0);
        if !no_queue {
            self.drained_since = None;
        } else if self.drained_since.is_none() {
            self.drained_since = Some(now);
        }
        let drained = self.drained_since;
        // Requests that ran start to end on an empty queue are the evidence of a tier's
        // unloaded TTFT and TPOT. A window holds few of them at a GPU's pace (answers of
        // seconds) or a tier's low rate, so they are kept past it (measured: Guaranteed's
        // unloaded TTFT was unknown for most of seed's run at 20 ms a decode step).
        if let Some(since) = drained {
            for o in outcomes.iter().filter(|o| !o.pending) {
                if o.started() < since {
                    continue;
                }
                let slo = &rules.tier(o.tier).slo;
                let ratios = o.ratios(slo);
                for dim in [Dim::Ttft, Dim::Tpot] {
                    let (Some(r), Some(target)) = (ratios[dim.index()], slo.get(dim)) else {
                        continue;
                    };
                    self.clean[o.tier.index()][dim.index()].push(r * target as f64);
                }
            }
        }
        // Readings per tier and dimension, as shares of its target. Rising looks only at
        // requests that started after the last rise (older ones describe a load already shed);
        // relaxing looks at the whole window, because just after a rise only the quick requests
        // have finished, and their good news would undo the rise before the slow ones report.
        // Headroom is the share of a dimension's budget (target less the tier's unloaded value)
        // that is still unspent: 1 on an unloaded fleet whatever the target, 0 once queueing
        // (TTFT, end to end) or the batch's growth (TPOT) has eaten the whole budget. A tier's
        // reading is its shortest dimension's.
        let mut dims = [[DimReading::default(); 3]; 3];
        let mut headroom = [None; 3];
        let mut relax_headroom = [None; 3];
        let mut fresh_headroom = [None; 3];
        let mut drained_headroom: [Option<f64>; 3] = [None; 3];
        let mut pace_headroom: [Option<f64>; 3] = [None; 3];
        let mut queue_headroom: [Option<f64>; 3] = [None; 3];
        let mut first_token_headroom: [Option<f64>; 3] = [None; 3];
        let mut missing = [0.0f64; 3];
        let mut unattainable = [false; 3];
        let min = |a: Option<f64>, b: Option<f64>| either(a, b, f64::min);
        for tier in Tier::ALL {
            let slo = rules.tier(tier).slo;
            let q = &self.recent[tier.index()];
            let running = &pending[tier.index()];
            let mut any_attainable = false;
            for dim in slo.dims() {
                let di = dim.index();
                let target = slo.get(dim).unwrap_or(1).max(1) as f64;
                let quantile_at = |since: Millis, level: f64| {
                    quantile_of(
                        started_since(q, since, di).collect(),
                        level,
                        tuning.min_samples,
                    )
                };
                let quantile = |since: Millis| quantile_at(since, tuning.quantile);
                // vLLM's own pace stands in for TPOT while this tier has too few streams of its
                // own: it decodes every request in the batch at one pace.
                let pace = signals
                    .itl_ms
                    .filter(|v| dim == Dim::Tpot && v.is_finite())
                    .filter(|_| !q.is_empty() || !running.is_empty())
                    .map(|v| v / target);
                // The pace is the current one; a stream's own TPOT arrives when it ends, a long
                // answer's seconds after the batch that set it.
                let current = |own: Option<f64>| pace.or(own);
                let whole = current(quantile(0));
                // The baseline takes a quantile of a few requests only when it has a few more
                // than the controller's readings need: the minimum of small samples is biased low.
                let sampled = |since: Millis| {
                    let v = started_since(q, since, di).collect();
                    current(quantile_of(
                        v,
                        tuning.quantile,
                        tuning.min_samples.max(BASELINE_MIN_SAMPLES),
                    ))
                };
                let b = &mut self.baseline[tier.index()][di];
                // The pace is learned only while nothing is shed or capped, and lets up ten
                // times slower: a batch that grew without a queue is the very load TPOT's budget
                // is spent on, never its new normal (a fleet that really decodes slower is
                // followed within minutes).
                let (learning, half_life) = match dim {
                    Dim::Tpot => (
                        self.level == 0.0,
                        PACE_HALF_LIVES * tuning.baseline_half_life_ms,
                    ),
                    _ => (true, tuning.baseline_half_life_ms),
                };
                let kept = if learning {
                    self.clean[tier.index()][di].take_quantile(tuning.quantile)
                } else {
                    None
                }
                .map(|ms| ms / target);
                b.learn(
                    self.drained_since
                        .filter(|_| learning)
                        .and_then(sampled)
                        .or(kept)
                        .map(|r| r * target),
                    dt,
                    half_life,
                );
                let base = b.ms.map_or(0.0, |ms| ms / target);
                let out_of_reach = base >= 1.0;
                any_attainable |= !out_of_reach;
                let slack = (1.0 - base).max(MIN_SLACK);
                // The share of the budget left once `observed` (and vLLM's queue delay, which a
                // request arriving now meets on top) is spent.
                let spend = |observed: f64, delay: f64| {
                    (1.0 - ((observed - base) + delay) / slack).max(-10.0)
                };
                // The queue delay spends the first token's budget (and the whole request's),
                // never the pace; and only of a tier that sends traffic to this pool. Latencies
                // arriving now were mostly queued before the current delay built up, so a new
                // request is expected to see both: the observed quantile plus today's wait.
                let delay = if dim == Dim::Tpot {
                    None
                } else if tier == Tier::Guaranteed {
                    g_delay_ms
                } else {
                    delay_ms
                }
                .filter(|_| !q.is_empty())
                .map(|d| d / target);
                // Without readings of its own a tier can only be told "short" (vLLM makes
                // everyone wait), never "plenty": an empty queue says nothing of service times.
                let room = |observed: Option<f64>| match (observed, delay) {
                    (Some(o), d) => Some(spend(o, d.unwrap_or(0.0))),
                    (None, Some(d)) if d > 0.0 => Some(spend(base, d)),
                    (None, _) => None,
                };
                let served: Vec<f64> = q.iter().filter_map(|(_, _, r)| r[di]).collect();
                let missed = if served.is_empty() {
                    0.0
                } else {
                    served.iter().filter(|r| **r > 1.0).count() as f64 / served.len() as f64
                };
                // Until requests admitted after the rise report, the window's median stands in
                // for their service time (the queue delay is added on top), but only while vLLM
                // still queues: then the contention that produced it is still there. The
                // median, not the quantile: the slow tail of the old answers is the queueing the
                // delay already counts.
                let queuing = delay_ms.is_some_and(|d| d > 0.0);
                let fresh = current(
                    quantile(self.last_change).or_else(|| quantile_at(0, 0.5).filter(|_| queuing)),
                );
                // The leading reading: the same quantile with the requests still running counted
                // at their age so far (a lower bound on their latency, or on their first
                // token's while it has not come). A request stuck in a queue shows here from the
                // moment it is older than the margin, not when it ends.
                let lead = censored_quantile(q, running, self.last_change, tuning, di)
                    .filter(|_| tuning.lead && pace.is_none());
                let rise = either(room(fresh), lead.map(|l| spend(l, 0.0)), f64::min);
                // Relaxing needs readings: a queue delay alone never proves there is room.
                let relax = whole.and(room(whole));
                let since_rise = current(quantile(self.last_change));
                let fresh_room = since_rise.and(room(since_rise));
                // Since vLLM's queue emptied: what the requests admitted into an empty queue
                // report, finished or still running at their age so far.
                let drained_room = drained
                    .and_then(|since| current(censored_quantile(q, running, since, tuning, di)))
                    .map(|r| spend(r, 0.0));
                dims[tier.index()][di] = DimReading {
                    target_ms: slo.get(dim),
                    headroom: relax.or(rise),
                    observed_ms: whole.map(|r| r * target),
                    lead_ms: lead.map(|r| r * target),
                    unloaded_ms: b.ms,
                    unattainable: out_of_reach,
                    missed,
                };
                if out_of_reach {
                    continue;
                }
                let t = tier.index();
                headroom[t] = min(headroom[t], rise);
                relax_headroom[t] = min(relax_headroom[t], relax);
                fresh_headroom[t] = min(fresh_headroom[t], fresh_room);
                drained_headroom[t] = min(drained_headroom[t], drained_room);
                missing[t] = missing[t].max(missed);
                if dim == Dim::Tpot {
                    pace_headroom[t] = rise;
                } else {
                    queue_headroom[t] = min(queue_headroom[t], rise);
                }
                if dim == Dim::Ttft {
                    first_token_headroom[t] = rise;
                }
            }
            unattainable[tier.index()] = !slo.is_empty() && !any_attainable;
        }
        let recent = &self.recent;
        let has_traffic = |t: Tier| !recent[t.index()].is_empty() || !pending[t.index()].is_empty();
        // The batch's own pace eating a tier's TPOT budget is evidence as a queue is: shedding
        // and capping shrink the batch, and its pace with it. While it is short, the pool is
        // neither calm nor idle.
        let under = |readings: &[Option<f64>; 3], mark: f64| {
            Tier::ALL
                .into_iter()
                .any(|t| has_traffic(t) && readings[t.index()].is_some_and(|h| h < mark))
        };
        let short = |readings: &[Option<f64>; 3]| under(readings, tuning.escalate_below);
        let pace_short = short(&pace_headroom);
        let pace_busy = under(&pace_headroom, BUSY_PACE_BELOW.max(tuning.escalate_below));
        // First tokens late with nothing queued are prefill contending with a full batch (vLLM
        // prefills and decodes in one step): shedding shrinks the batch, so it is evidence too
        // while the cache is not idle. An end-to-end latency over budget without a queue is the
        // answer's own decode pace and is not (measured: shedding for it cost lower tiers far
        // more than it bought).
        let prefill_short = short(&first_token_headroom);
        // Idle: nothing waits in vLLM and its cache is far from full. Whatever the latencies
        // say, shedding or shaping then cannot make anyone faster (nothing queues to be cut),
        // so after `idle_release_ms` of it every request is let through as it is.
        let low_kv = signals
            .pressure
            .zip(tuning.idle_pressure_below)
            .is_some_and(|(p, below)| p < below);
        if !(no_queue && low_kv) || pace_short {
            self.idle_since = None;
        } else if self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
        let idle = self
            .idle_since
            .is_some_and(|t| now.saturating_sub(t) >= tuning.idle_release_ms);
        let protects = |i: usize, t: Tier| {
            let s = steps[i];
            match s.kind {
                StepKind::Shed => rank(t) > rank(s.tier),
                _ => rank(t) >= rank(s.tier),
            }
        };
        // Step `i` may be relaxed when every protected tier present on the pool shows enough
        // headroom. A tier whose target is below its unloaded latency holds nothing up (no
        // shedding buys it its target), and one with no reading yet holds nothing up while
        // vLLM queues nothing: a tier that is being shed reports no latencies, and the level
        // must not stay up for want of them.
        let relaxable = |i: usize| {
            let enough = |readings: &[Option<f64>; 3]| {
                Tier::ALL
                    .into_iter()
                    .filter(|t| protects(i, *t) && has_traffic(*t) && !unattainable[t.index()])
                    .all(|t| match readings[t.index()] {
                        Some(h) => h >= tuning.relax_above,
                        None => no_queue,
                    })
            };
            enough(&relax_headroom)
                || (no_queue && enough(&fresh_headroom))
                || (drained.is_some() && enough(&drained_headroom))
        };
        let n = steps.len() as f64;
        self.level = self.level.min(n);

        let rail = rail_of(tuning, signals);
        let full = signals
            .pressure
            .zip(tuning.shape_pressure_at)
            .is_some_and(|(p, at)| p >= at);
        let floor = shape_floor(&steps);
        // A nearly full cache keeps the shaping steps: only what lies above them may fall.
        let keep = if full { floor } else { 0.0 };
        // Calm: vLLM says nothing waits and its cache is below the shaping floor. Then no
        // request waits anywhere that a refusal here would shorten: a latency over the
        // baseline without a queue is the batch's own pace (or a slow GPU), and shedding for
        // it was measured to cost lower tiers far more than it bought (bench/RESULTS.md).
        // Unknown queue signals are not calm: then the latencies alone must speak.
        // One empty reading in the middle of a peak is a gap between arrivals, not a drain: a
        // level cut to a third on it lets the lower tiers back in at once and the queue
        // returns in front of Guaranteed (seen live on one shared backend). So calm needs the
        // queue empty at two samples in a row.
        let settled = drained.is_some_and(|t| t < now);
        let calm = no_queue && settled && !full && !pace_short && (low_kv || !prefill_short);
        let mut moved = Movement::Hold;
        if let Some(kind) = rail {
            let floor = rail_level(&steps);
            if self.level < floor {
                self.level = floor;
                self.last_rise = Some(now);
                self.last_change = now;
            }
            moved = Movement::Rail(kind);
        } else if idle {
            if self.level > 0.0 {
                self.level = 0.0;
                moved = Movement::Idle;
            }
        } else {
            // The floor answers the cache, not a latency: the requests admitted before it
            // still say how the tiers fare, so the evidence is not restarted.
            if full && self.level < floor {
                self.level = floor;
                self.last_rise = Some(now);
                moved = Movement::Shape;
            }
            // Escalate into the first step (at or above the level) whose tier has traffic here.
            let mut i = self.level.floor() as usize;
            while i < steps.len() && !has_traffic(steps[i].tier) {
                i += 1;
            }
            // Each protected tier short of headroom asks for a rise in proportion to its
            // shortfall, up to the first step that does not protect it (an overshoot must not
            // shed a tier for its own latency either); the largest rise wins. A tier that
            // misses its target unloaded asks for nothing: no shedding gets it there. Nor does
            // anyone while vLLM shows that nothing queues: latency without a queue is the
            // batch's own pace, which refusing requests here would not buy back.
            let base = self.level.max(i as f64);
            // The pace answers a rise only as the answers already decoding finish (seconds on a
            // GPU), so while it improves after a pace-driven rise, no further rise is asked of
            // it: the batch is shrinking already.
            let itl = signals.itl_ms.filter(|v| v.is_finite());
            let pace_may_rise = self.pace_rise.is_none_or(|(t0, p0)| {
                now.saturating_sub(t0) >= tuning.hold_ms
                    && itl.is_none_or(|p| p >= PACE_EASING * p0)
            });
            let rise = Tier::ALL
                .into_iter()
                .filter(|t| i < steps.len() && protects(i, *t))
                .filter(|t| !unattainable[t.index()])
                .filter_map(|t| {
                    let queue = queue_headroom[t.index()].filter(|_| !calm);
                    let pace = pace_headroom[t.index()].filter(|_| pace_may_rise);
                    match (queue, pace) {
                        (Some(q), Some(p)) if p < q => Some((t, p, true)),
                        (Some(q), _) => Some((t, q, false)),
                        (None, Some(p)) => Some((t, p, true)),
                        (None, None) => None,
                    }
                })
                .filter(|(_, h, _)| *h < tuning.escalate_below)
                .map(|(t, h, by_pace)| {
                    let up = (tuning.rise_gain * (tuning.escalate_below - h))
                        .clamp(tuning.min_step_up, tuning.max_step_up);
                    let ceiling = (i..steps.len())
                        .find(|j| !protects(*j, t))
                        .map_or(n, |j| j as f64);
                    (t, h, (base + up).min(ceiling), by_pace)
                })
                .max_by(|a, b| a.2.total_cmp(&b.2));
            if !pace_short {
                self.pace_rise = None;
            }
            let held = self
                .last_rise
                .is_some_and(|t| now.saturating_sub(t) < tuning.hold_ms);
            if let Some((tier, h, risen, by_pace)) = rise {
                if by_pace {
                    self.pace_rise = itl.map(|p| (now, p));
                }
                self.level = risen;
                self.last_rise = Some(now);
                self.last_change = now;
                moved = Movement::Up { tier, headroom: h };
            } else if self.level > keep && !held {
                // Relax the highest step in force, skipping steps nobody on this pool takes,
                // but never below the shaping floor a full cache keeps.
                let mut top = self.level.ceil() as usize;
                while top > 0 && !has_traffic(steps[top - 1].tier) {
                    top -= 1;
                }
                let before = self.level;
                self.level = self.level.min(top as f64).max(keep);
                if calm {
                    // Nothing queues: the level has no reason to be up, so it falls to a third
                    // each sample (from the top of the ladder to 0 in three).
                    let third = self.level / 3.0;
                    self.level = if third < CALM_SNAP { 0.0 } else { third }.max(keep);
                } else if self.level > keep && (top == 0 || relaxable(top - 1)) {
                    // Down by step_down, faster with ample headroom: up to 4× at twice
                    // relax_above.
                    let h = Tier::ALL
                        .into_iter()
                        .filter(|t| top > 0 && protects(top - 1, *t))
                        .filter_map(|t| {
                            either(
                                relax_headroom[t.index()],
                                drained_headroom[t.index()],
                                f64::max,
                            )
                        })
                        .fold(2.0 * tuning.relax_above, f64::min);
                    let speed = (h / tuning.relax_above.max(0.05)).clamp(1.0, 4.0);
                    self.level = (self.level - tuning.step_down * speed).max(keep);
                }
                if self.level < before {
                    moved = if calm { Movement::Calm } else { Movement::Down };
                }
            }
        }
        // A pool is too full to take fallback traffic once a tier it serves is close to its
        // target (a tenth of it left), not merely below the escalation margin: the fallback is
        // worth some of the lowest tier's slack.
        // What `/status` shows: the window's reading, or the queue delay's when no latency is in.
        let shown: [Option<f64>; 3] =
            Tier::ALL.map(|t| relax_headroom[t.index()].or(headroom[t.index()]));
        let saturated = shown
            .iter()
            .zip(unattainable)
            .any(|(h, u)| !u && h.is_some_and(|h| h < SATURATED_BELOW))
            || missing
                .iter()
                .zip(unattainable)
                .any(|(m, u)| !u && *m > SATURATED_MISSING);
        let short = matches!(moved, Movement::Up { .. } | Movement::Rail(_));
        let usage = signals.pressure.map(|p| p / 100.0);
        self.pace_fit.sample(usage, signals.itl_ms, dt as f64);
        // The gate protects the tiers above the lowest one on the pool (a tier is never gated
        // for its own latency): the pace at which the tightest of their TPOT budgets turns
        // short, where its headroom falls to `escalate_below` above its unloaded value.
        let lowest = Tier::ALL
            .into_iter()
            .filter(|t| has_traffic(*t))
            .map(rank)
            .min();
        // Nor for a tier whose requests here are only the fallback model's, borrowed from the
        // tier's own pool: a fallback rides on this pool's spare capacity and must not hold
        // back the pool's own tenants (they would end worse off than with no proxy, which
        // never sends the borrowed answers here); the ladder still answers a shortage of it.
        let borrowed = |t: Tier| {
            !rules.spot_is_on_demand
                && rules.fallback_capacity == FallbackCapacity::On(pool)
                && rules.tier(t).preferred_pool != pool
        };
        let protected =
            |t: Tier| has_traffic(t) && !borrowed(t) && lowest.is_some_and(|l| rank(t) > l);
        let pace_limit = Tier::ALL
            .into_iter()
            .filter(|t| protected(*t) && !unattainable[t.index()])
            .filter_map(|t| pace_mark(&dims[t.index()], 1.0 - tuning.escalate_below))
            .reduce(f64::min);
        let learned = if tuning.work_gate {
            self.work
                .sample(signals.inflight_work, short, now, tuning.hold_ms)
        } else {
            None
        };
        // The predicted ceiling holds whether or not the learned limit is on: it needs no
        // shortage to have happened first.
        // No protected tier on the pool, no pace limit, no ceiling.
        let predicted = ceiling::ceiling(&self.pace_fit, pace_limit, usage, signals.inflight_work);
        let work_limit = either(learned, predicted, f64::min);
        // What the pool lends is judged for its own tenants, the lowest tier included: direct,
        // they would have it to themselves (measured without it: Best-Effort on spot up to 16
        // points under direct once Guaranteed overflows there). The pace mark is the one that
        // calls a pool busy; the cache mark answers an engine whose pace does not grow with it
        // and that queues once its cache is reserved.
        let home_pace_limit = Tier::ALL
            .into_iter()
            .filter(|t| has_traffic(*t) && rules.tier(*t).preferred_pool == pool)
            .filter(|t| !unattainable[t.index()])
            .filter_map(|t| pace_mark(&dims[t.index()], 1.0 - BUSY_PACE_BELOW))
            .reduce(f64::min);
        let pace_lend = ceiling::ceiling(
            &self.pace_fit,
            home_pace_limit,
            usage,
            signals.inflight_work,
        );
        let cache_lend = tuning
            .idle_pressure_below
            .zip(usage)
            .zip(signals.inflight_work)
            .and_then(|((mark, u), w)| ceiling::work_at(mark / 100.0, u, w));
        let lend_limit = either(pace_lend, cache_lend, f64::min);
        PoolControl {
            level: self.level,
            steps,
            headroom: shown,
            latency_ms: primary(&dims, rules, |r| r.observed_ms),
            lead_ms: primary(&dims, rules, |r| r.lead_ms),
            delay_ms,
            rail,
            shaping: full && rail.is_none(),
            filling: signals
                .pressure
                .zip(tuning.fallback_pressure_at)
                .map(|(p, at)| p >= at),
            moved,
            saturated,
            work_limit,
            inflight_work: signals.inflight_work,
            lend_limit,
            unloaded_ms: primary(&dims, rules, |r| r.unloaded_ms),
            dims,
            unattainable,
            idle,
            busy: !(no_queue && low_kv) || pace_busy,
            pace_busy,
            pace_ms: signals.itl_ms.filter(|v| v.is_finite()),
        }
    }
}

/// The pace (ms a token) at which a tier has spent `spent` of its TPOT budget on this pool: its
/// learned unloaded pace plus that share of the way to its target.
fn pace_mark(dims: &[DimReading; 3], spent: f64) -> Option<f64> {
    let d = &dims[Dim::Tpot.index()];
    let target = d.target_ms? as f64;
    let base = d.unloaded_ms.unwrap_or(0.0).min(target);
    Some(base + spent * (target - base))
}

/// Two readings joined by `join` when both are known, else whichever is.
fn either(a: Option<f64>, b: Option<f64>, join: fn(f64, f64) -> f64) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(join(a, b)),
        (a, b) => a.or(b),
    }
}

/// The `tuning.quantile` of a tier's latency ratios over the requests that started at or after
/// `since`: the finished ones as they ended and the ones still running (`pending`) at their age
/// so far. A running request's age is a lower bound on its latency, so this reading only ever
/// underestimates the quantile those requests will end with, and it sees a queue build up while
/// the requests stuck in it are still waiting. `None` below `min_samples`.
fn censored_quantile(
    finished: &VecDeque<Reading>,
    pending: &[(Millis, [Option<f64>; 3])],
    since: Millis,
    tuning: &AdaptiveTuning,
    dim: usize,
) -> Option<f64> {
    let running = pending
        .iter()
        .filter(|(started, _)| *started >= since)
        .filter_map(|(_, r)| r[dim]);
    let v = started_since(finished, since, dim).chain(running).collect();
    quantile_of(v, tuning.quantile, tuning.min_samples)
}

/// Dimension `dim`'s readings of the finished requests that started at or after `since`.
fn started_since(
    finished: &VecDeque<Reading>,
    since: Millis,
    dim: usize,
) -> impl Iterator<Item = f64> + '_ {
    finished
        .iter()
        .filter(move |(_, started, _)| *started >= since)
        .filter_map(move |(_, _, r)| r[dim])
}

/// The `level` quantile of `v`; `None` below `min_samples` values.
fn quantile_of(mut v: Vec<f64>, level: f64, min_samples: usize) -> Option<f64> {
    (v.len() >= min_samples.max(1)).then(|| {
        let idx = ((v.len() as f64 * level).ceil() as usize).clamp(1, v.len()) - 1;
        // The same value a full sort puts there, in linear time: the window holds every
        // request of the last few seconds, and this runs once a sample per tier and pool.
        *v.select_nth_unstable_by(idx, f64::total_cmp).1
    })
}

/// The hard rail a pool's own signals trip, if any (KV usage first).
pub fn rail_of(tuning: &AdaptiveTuning, signals: &PoolSignals) -> Option<RailKind> {
    match (signals.pressure, signals.queue_depth) {
        (Some(p), _) if tuning.rail_pressure_at.is_some_and(|r| p >= r) => Some(RailKind::Pressure),
        (_, Some(q)) if tuning.rail_queue_depth_at.is_some_and(|r| q >= r) => {
            Some(RailKind::QueueDepth)
        }
        _ => None,
    }
}

/// A request's ticket from its id (FNV-1a): a request keeps its place in its tier's shares
/// however often the policy is asked, and ids spread evenly.
pub fn ticket_of(request_id: &str) -> u64 {
    request_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A request's ticket as a uniform draw in [0, 1): the same ticket always gives the same draw.
pub fn draw(ticket: u64) -> f64 {
    // splitmix64's finaliser: consecutive tickets spread over the whole range.
    let mut z = ticket.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(at: Millis, tier: Tier, latency_ms: f64) -> Outcome {
        Outcome::served(at, tier, latency_ms)
    }

    fn batch(at: Millis, tier: Tier, latency_ms: f64, n: usize) -> Vec<Outcome> {
        (0..n).map(|_| served(at, tier, latency_ms)).collect()
    }

    #[test]
    fn the_quantile_is_the_nearest_rank_of_the_sorted_window() {
        // A fixed pseudo-random window with ties; the nearest-rank quantile of its sorted copy.
        let mut x = 7u64;
        let window: Vec<f64> = (0..997)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) % 300) as f64 / 100.0
            })
            .collect();
        let mut sorted = window.clone();
        sorted.sort_by(f64::total_cmp);
        for level in [0.0, 0.5, 0.9, 0.99, 1.0] {
            let rank = (997.0_f64 * level).ceil().clamp(1.0, 997.0) as usize;
            assert_eq!(
                quantile_of(window.clone(), level, 4),
                Some(sorted[rank - 1]),
                "{level}"
            );
        }
        assert_eq!(quantile_of(vec![1.0, 2.0, 3.0], 0.9, 4), None, "too few");
        assert_eq!(quantile_of(vec![3.0, 1.0, 2.0, 4.0], 0.5, 4), Some(2.0));
    }

    /// A pool's signals with only its KV usage known.
    fn kv(pressure: f64) -> PoolSignals {
        PoolSignals {
            pressure: Some(pressure),
            ..Default::default()
        }
    }

    /// Round numbers, so each test can state its arithmetic; the shipped defaults are checked
    /// end to end by the benchmarks.
    fn tuning() -> AdaptiveTuning {
        AdaptiveTuning {
            escalate_below: 0.2,
            relax_above: 0.35,
            rise_gain: 2.0,
            max_step_up: 1.0,
            min_step_up: 0.25,
            step_down: 0.1,
            ..AdaptiveTuning::default()
        }
    }

    #[test]
    fn the_shipped_ladder_caps_then_falls_back_then_sheds_lowest_first() {
        let names: Vec<String> = ladder(&PolicyRules::default(), Pool::OnDemand)
            .iter()
            .map(|s| format!("{} {}", s.tier, s.kind.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                "Standard cap",
                "Standard brownout",
                "Standard fallback",
                "Best-Effort shed",
                "Standard shed",
                "Guaranteed cap"
            ]
        );
    }

    #[test]
    fn a_tier_is_not_shed_for_its_own_latency() {
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        // Best-Effort alone on the pool, every request twice its target.
        for s in 1..=10 {
            let ctl = c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &PoolSignals::default(),
                &batch(s * 1000, Tier::BestEffort, 1000.0, 10),
                s * 1000,
            );
            assert_eq!(ctl.shares(Tier::BestEffort).shed, 0.0, "sample {s}");
        }
        assert!(c
            .observe(
                Pool::OnDemand,
                &rules,
                &t,
                &PoolSignals::default(),
                &[],
                11_000
            )
            .headroom[2]
            .is_some_and(|h| h < 0.0));
    }

    #[test]
    fn guaranteed_short_of_headroom_caps_standard_then_sheds_best_effort() {
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        let mut ctl = None;
        // 20 % over target: each sample rises 2 × (0.2 + 0.2) = 0.8 steps. Samples are 3 s
        // apart so each batch started after the previous rise (older ones are no evidence).
        for s in 1..=4 {
            let at = s * 3000;
            let mut o = batch(at, Tier::Guaranteed, 2400.0, 10);
            o.extend(batch(at, Tier::Standard, 400.0, 10));
            o.extend(batch(at, Tier::BestEffort, 300.0, 10));
            ctl = Some(c.observe(Pool::OnDemand, &rules, &t, &PoolSignals::default(), &o, at));
        }
        let ctl = ctl.unwrap();
        assert!(matches!(
            ctl.moved,
            Movement::Up {
                tier: Tier::Guaranteed,
                ..
            }
        ));
        let st = ctl.shares(Tier::Standard);
        let applied = (st.cap, st.brownout, st.fallback, st.shed);
        assert_eq!(applied, (1.0, 1.0, 1.0, 0.0), "{ctl:?}");
        assert!(
            (ctl.shares(Tier::BestEffort).shed - 0.2).abs() < 1e-9,
            "{ctl:?}"
        );
        assert_eq!(ctl.shares(Tier::Guaranteed), Shares::default());
    }

    /// Standard far over its own target while Best-Effort is partly shed: the rise it asks for
    /// (capped at one step here) would run into Standard's own shed step; it stops before it.
    #[test]
    fn a_tier_short_of_headroom_never_pushes_the_level_into_its_own_shed_step() {
        let rules = PolicyRules::default();
        let t = tuning();
        let steps = ladder(&rules, Pool::OnDemand);
        let std_shed = steps
            .iter()
            .position(|s| (s.tier, s.kind) == (Tier::Standard, StepKind::Shed))
            .unwrap();
        // Half a step below Standard's shed step, with Guaranteed answering in `g_ms`.
        let observe = |g_ms: f64| {
            let mut c = PoolController::new();
            c.level = std_shed as f64 - 0.5;
            let mut o = batch(3000, Tier::Guaranteed, g_ms, 10);
            o.extend(batch(3000, Tier::Standard, 1500.0, 10));
            o.extend(batch(3000, Tier::BestEffort, 200.0, 10));
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &PoolSignals::default(),
                &o,
                3000,
            )
        };
        let ctl = observe(500.0);
        let by_standard = matches!(
            ctl.moved,
            Movement::Up {
                tier: Tier::Standard,
                ..
            }
        );
        assert!(by_standard, "{ctl:?}");
        assert_eq!(ctl.level, std_shed as f64, "{ctl:?}");
        assert_eq!(ctl.shares(Tier::Standard).shed, 0.0);
        assert_eq!(ctl.shares(Tier::BestEffort).shed, 1.0);
        // Guaranteed short as well: its rise goes on into Standard's shed step.
        let ctl = observe(2500.0);
        assert!(ctl.shares(Tier::Standard).shed > 0.0, "{ctl:?}");
    }

    #[test]
    fn recovery_is_slow_and_held_after_a_rise() {
        let rules = PolicyRules::default();
        let t = tuning();
        let none = PoolSignals::default();
        let mixed = |at: Millis, g_ms: f64| {
            let mut o = batch(at, Tier::Guaranteed, g_ms, 10);
            o.extend(batch(at, Tier::Standard, 300.0, 10));
            o
        };
        // A controller that has just risen on Guaranteed answers 50 % over target.
        let risen_at_1s = || {
            let mut c = PoolController::new();
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &none,
                &mixed(1000, 3000.0),
                1000,
            );
            c
        };
        let mut c = risen_at_1s();
        let risen = c.level();
        assert_eq!(risen, 1.0, "a deep shortfall rises a whole step");
        // Fast, healthy answers once the old ones left the window: down by step_down, faster
        // with ample headroom (at most 4×).
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &none, &mixed(6000, 100.0), 6000);
        assert_eq!(ctl.moved, Movement::Down);
        let fell = risen - c.level();
        assert!(fell >= t.step_down && fell <= 4.0 * t.step_down, "{fell}");
        // Within hold_ms of a rise the level stays, even with good news.
        let mut c2 = risen_at_1s();
        let held = c2.observe(Pool::OnDemand, &rules, &t, &none, &[], 2000);
        assert_eq!((held.moved, c2.level()), (Movement::Hold, 1.0));
    }

    #[test]
    fn requests_started_before_a_rise_are_no_evidence_against_it() {
        let rules = PolicyRules::default();
        let t = tuning();
        let none = PoolSignals::default();
        let mut c = PoolController::new();
        let mut o = batch(1000, Tier::Guaranteed, 3000.0, 10);
        o.extend(batch(1000, Tier::Standard, 300.0, 10));
        c.observe(Pool::OnDemand, &rules, &t, &none, &o, 1000);
        assert_eq!(c.level(), 1.0);
        // Late answers of requests admitted before the rise: no second rise on them.
        let late = batch(2500, Tier::Guaranteed, 2500.0, 10);
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &none, &late, 2500);
        assert_eq!((ctl.moved, c.level()), (Movement::Hold, 1.0));
        // Slow answers of requests admitted after it are evidence.
        let fresh = batch(3500, Tier::Guaranteed, 2400.0, 10);
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &none, &fresh, 3500);
        assert!(matches!(ctl.moved, Movement::Up { .. }), "{ctl:?}");
    }

    #[test]
    fn the_queue_delay_counts_before_any_completion() {
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        let arrived = [Outcome::arrival(1000, Tier::Guaranteed)];
        let sig = PoolSignals {
            queue_time_ms: Some(1800.0),
            ..Default::default()
        };
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &sig, &arrived, 1000);
        assert!((ctl.headroom[0].unwrap() - 0.1).abs() < 1e-9);
        assert!(ctl.level > 0.0);
    }

    /// The interval's mean wait with nobody waiting now is the backlog that just drained: a
    /// request arriving now meets no queue, so it raises nothing.
    #[test]
    fn a_drained_queue_delays_nobody() {
        let rules = PolicyRules::default();
        let t = tuning();
        let arrived = [Outcome::arrival(1000, Tier::Guaranteed)];
        let at = |waiting| {
            let sig = PoolSignals {
                queue_time_ms: Some(1800.0),
                queue_depth: Some(waiting),
                ..Default::default()
            };
            PoolController::new().observe(Pool::OnDemand, &rules, &t, &sig, &arrived, 1000)
        };
        let drained = at(0.0);
        assert_eq!((drained.delay_ms, drained.level), (Some(0.0), 0.0));
        let queued = at(3.0);
        assert_eq!(queued.delay_ms, Some(1800.0));
        assert!(queued.level > 0.0);
    }

    /// The leading reading: Guaranteed requests stuck for 90 % of their target raise the level
    /// while not one of them has answered yet; without it the controller would wait for them.
    #[test]
    fn the_level_rises_before_any_request_completes_when_in_flight_requests_age() {
        let rules = PolicyRules::default();
        let t = tuning();
        let none = PoolSignals::default();
        let run = |t: &AdaptiveTuning| {
            let mut c = PoolController::new();
            let mut arrived: Vec<Outcome> = (0..10)
                .map(|_| Outcome::arrival(1000, Tier::Guaranteed))
                .collect();
            arrived.extend((0..10).map(|_| Outcome::arrival(2700, Tier::Standard)));
            c.observe(Pool::OnDemand, &rules, t, &none, &arrived, 1000);
            // 1.8 s later: every one of them still running, the Guaranteed ones at 0.9 of
            // their 2 s target, Standard's just sent.
            let mut running: Vec<Outcome> = (0..10)
                .map(|_| Outcome::pending(2800, Tier::Guaranteed, 1800.0))
                .collect();
            running.extend((0..10).map(|_| Outcome::pending(2800, Tier::Standard, 100.0)));
            c.observe(Pool::OnDemand, &rules, t, &none, &running, 2800)
        };
        let ctl = run(&t);
        assert!(
            matches!(
                ctl.moved,
                Movement::Up {
                    tier: Tier::Guaranteed,
                    ..
                }
            ),
            "{ctl:?}"
        );
        assert!(ctl.level > 0.0 && ctl.shares(Tier::Standard).cap > 0.0);
        assert_eq!(ctl.lead_ms[0], Some(1800.0));
        let lagging = run(&AdaptiveTuning {
            lead: false,
            ..t.clone()
        });
        assert_eq!((lagging.level, lagging.moved), (0.0, Movement::Hold));
    }

    /// Requests still running count for the sample that reports them only: once they have
    /// ended (and said nothing more), they no longer hold the level up.
    #[test]
    fn running_requests_are_not_remembered() {
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        let none = PoolSignals::default();
        let stuck: Vec<Outcome> = (0..10)
            .map(|_| Outcome::pending(1000, Tier::Guaranteed, 1900.0))
            .collect();
        let first = c.observe(Pool::OnDemand, &rules, &t, &none, &stuck, 1000);
        assert!(first.lead_ms[0].is_some());
        let later = c.observe(Pool::OnDemand, &rules, &t, &none, &[], 1500);
        assert_eq!(later.lead_ms[0], None);
    }

    /// After a rise, the requests admitted while vLLM still queued finish late for a while; once
    /// its queue is empty, the requests admitted since speak for the level in force. With the
    /// cache still full (the shaping floor held, so not calm), they let the steps above the
    /// floor go while the window still holds the late answers.
    #[test]
    fn the_level_relaxes_once_the_queue_drains_on_what_was_admitted_since() {
        let rules = PolicyRules::default();
        let t = tuning();
        let floor = shape_floor(&ladder(&rules, Pool::OnDemand));
        let signals = |waiting: f64| PoolSignals {
            pressure: Some(95.0),
            queue_time_ms: Some(0.0),
            queue_depth: Some(waiting),
            ..Default::default()
        };
        let mut c = PoolController::new();
        let mut o = batch(1000, Tier::Guaranteed, 3000.0, 10);
        o.extend(batch(1000, Tier::Standard, 300.0, 10));
        o.extend(batch(1000, Tier::BestEffort, 300.0, 10));
        c.level = floor + 1.0;
        c.observe(Pool::OnDemand, &rules, &t, &signals(2.0), &o, 1000);
        let risen = c.level();
        assert!(risen > floor + 1.0);
        // Admitted behind the queue, answered late (the window keeps them for 3 s).
        let late = batch(2000, Tier::Guaranteed, 1900.0, 10);
        c.observe(Pool::OnDemand, &rules, &t, &signals(2.0), &late, 2000);
        // The queue empties at 2.5 s; what was admitted since is quick.
        c.observe(Pool::OnDemand, &rules, &t, &signals(0.0), &[], 2500);
        let mut quick = batch(3600, Tier::Guaranteed, 600.0, 10);
        quick.extend(batch(3600, Tier::Standard, 200.0, 10));
        quick.extend(batch(3600, Tier::BestEffort, 200.0, 10));
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &signals(0.0), &quick, 3600);
        assert!(ctl.latency_ms[0].is_some_and(|ms| ms > 1800.0), "{ctl:?}");
        assert_eq!(ctl.moved, Movement::Down);
        assert!(c.level() < risen && c.level() >= floor, "{}", c.level());
    }

    /// One tier's life on a pool with its target at `x` times its unloaded latency: quiet (the
    /// baseline is learned), then congested (vLLM queues, answers take twice the target, the
    /// level rises), then the queue empties and answers are back to the unloaded latency with
    /// the cache half full. Returns the level at each sample after the queue emptied.
    fn congestion_then_calm(x: f64, kv_after: f64) -> Vec<(Millis, f64)> {
        let unloaded = 1000.0;
        let mut rules = PolicyRules::default();
        for (tier, ms) in [
            (Tier::Guaranteed, unloaded * x),
            (Tier::Standard, unloaded * x),
            (Tier::BestEffort, unloaded * x),
        ] {
            rules.tiers[tier.index()].slo = crate::slo::Slo::e2e(ms as u64);
        }
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let sig = |pressure: f64, waiting: f64, delay: f64| PoolSignals {
            pressure: Some(pressure),
            queue_depth: Some(waiting),
            queue_time_ms: Some(delay),
            ..Default::default()
        };
        let all = |at: Millis, ms: f64| -> Vec<Outcome> {
            Tier::ALL
                .into_iter()
                .flat_map(|tier| batch(at, tier, ms, 6))
                .collect()
        };
        let mut at = 0;
        for _ in 0..20 {
            at += 500;
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &sig(30.0, 0.0, 0.0),
                &all(at, unloaded),
                at,
            );
        }
        assert!(c.baseline[0][Dim::E2e.index()]
            .ms
            .is_some_and(|b| (b - unloaded).abs() < 1.0));
        for _ in 0..10 {
            at += 500;
            let late = all(at, 2.0 * unloaded * x);
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &sig(85.0, 8.0, unloaded * x),
                &late,
                at,
            );
        }
        assert!(
            c.level() > 2.0,
            "x = {x}: congestion raised the level to {}",
            c.level()
        );
        (0..12)
            .map(|_| {
                at += 500;
                let quick = all(at, unloaded);
                c.observe(
                    Pool::OnDemand,
                    &rules,
                    &t,
                    &sig(kv_after, 0.0, 0.0),
                    &quick,
                    at,
                );
                (at, c.level())
            })
            .collect()
    }

    /// One empty reading of vLLM's queue in the middle of a peak is a gap between arrivals, not
    /// a drain: the level is not cut to a third on it. The queue empty at two samples in a row
    /// is calm.
    #[test]
    fn one_empty_queue_reading_in_a_peak_is_not_calm() {
        let rules = PolicyRules::default();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let sig = |waiting: f64| PoolSignals {
            pressure: Some(80.0),
            queue_depth: Some(waiting),
            queue_time_ms: Some(if waiting > 0.0 { 400.0 } else { 0.0 }),
            ..Default::default()
        };
        let mut at = 0;
        // Guaranteed queued well past its 2,000 ms target: the level rises.
        for _ in 0..4 {
            at += 500;
            let late = batch(at, Tier::Guaranteed, 2600.0, 6);
            c.observe(Pool::OnDemand, &rules, &t, &sig(8.0), &late, at);
        }
        let risen = c.level();
        assert!(risen >= 2.0, "{risen}");
        // Past the hold, the queue still there, no new answers: the level stays up.
        at += t.hold_ms;
        c.observe(Pool::OnDemand, &rules, &t, &sig(8.0), &[], at);
        let before = c.level();
        assert!(before >= 2.0, "{before}");
        at += 500;
        let gap = c.observe(Pool::OnDemand, &rules, &t, &sig(0.0), &[], at);
        assert_ne!(gap.moved, Movement::Calm, "{gap:?}");
        assert!(gap.level > before / 3.0 + 0.5, "{gap:?}");
        at += 500;
        let drained = c.observe(Pool::OnDemand, &rules, &t, &sig(0.0), &[], at);
        assert_eq!(drained.moved, Movement::Calm, "{drained:?}");
        assert!(drained.level < gap.level, "{drained:?}");
    }

    /// The issue's grid: whatever the targets' distance from the unloaded latency, the level is
    /// back at 0 within 3 s of vLLM's queue emptying (here with the cache at 60 %, so the idle
    /// rule does not do it alone), and stays there.
    #[test]
    fn the_level_returns_to_zero_within_three_seconds_of_the_queue_emptying_whatever_the_targets() {
        for x in [1.3, 1.6, 2.0, 4.0, 10.0] {
            let after = congestion_then_calm(x, 60.0);
            let emptied = after[0].0 - 500;
            let zero = after
                .iter()
                .find(|(_, l)| *l == 0.0)
                .map(|(t, _)| t - emptied);
            assert!(zero.is_some_and(|ms| ms <= 3000), "x = {x}: {after:?}");
            assert!(
                after
                    .iter()
                    .skip_while(|(_, l)| *l > 0.0)
                    .all(|(_, l)| *l == 0.0),
                "x = {x}: {after:?}"
            );
        }
    }

    /// Idle means open: with nothing waiting in vLLM and its cache below 50 %, the level is 0
    /// once that has lasted `idle_release_ms`, even within `hold_ms` of a rise and with
    /// latencies that never reported well.
    #[test]
    fn an_idle_pool_refuses_and_caps_nobody() {
        let rules = PolicyRules::default();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        c.level = 5.0;
        c.last_rise = Some(900);
        let idle = PoolSignals {
            pressure: Some(20.0),
            queue_depth: Some(0.0),
            queue_time_ms: Some(0.0),
            ..Default::default()
        };
        // Guaranteed's window still holds answers twice its target.
        let slow = batch(1000, Tier::Guaranteed, 4000.0, 10);
        let first = c.observe(Pool::OnDemand, &rules, &t, &idle, &slow, 1000);
        assert!(!first.idle);
        let ctl = c.observe(
            Pool::OnDemand,
            &rules,
            &t,
            &idle,
            &[],
            1000 + t.idle_release_ms,
        );
        assert!(ctl.idle);
        assert_eq!(ctl.level, 0.0);
        for tier in Tier::ALL {
            assert_eq!(ctl.shares(tier), Shares::default(), "{tier}");
        }
    }

    /// A shed tier reports no latencies, and a protected tier with too few answers reports no
    /// quantile: neither may hold the level up while vLLM queues nothing.
    #[test]
    fn a_level_is_never_held_up_by_missing_samples() {
        let rules = PolicyRules::default();
        let t = AdaptiveTuning::default();
        let steps = ladder(&rules, Pool::OnDemand);
        let std_shed = steps
            .iter()
            .position(|s| (s.tier, s.kind) == (Tier::Standard, StepKind::Shed))
            .unwrap();
        let mut c = PoolController::new();
        c.level = (std_shed + 1) as f64;
        // The cache is busy (not idle) but nothing queues.
        let busy = PoolSignals {
            pressure: Some(70.0),
            queue_depth: Some(0.0),
            queue_time_ms: Some(0.0),
            ..Default::default()
        };
        let mut at = 0;
        let mut levels = Vec::new();
        for _ in 0..8 {
            at += 500;
            // Standard and Best-Effort only arrive (they are refused), Guaranteed has two
            // answers in the window: below min_samples.
            let mut o: Vec<Outcome> = [Tier::Standard, Tier::BestEffort]
                .into_iter()
                .map(|tier| Outcome::arrival(at, tier))
                .collect();
            o.extend(batch(
                at,
                Tier::Guaranteed,
                900.0,
                usize::from(at % 1500 == 0),
            ));
            levels.push(c.observe(Pool::OnDemand, &rules, &t, &busy, &o, at).level);
        }
        assert_eq!(levels.last(), Some(&0.0), "{levels:?}");
    }

    /// A target tighter than the tier's unloaded latency: no shedding gets it there, so the
    /// tier is reported and raises nothing, even while vLLM queues.
    #[test]
    fn a_target_below_the_unloaded_latency_is_reported_and_sheds_nobody() {
        let mut rules = PolicyRules::default();
        rules.tiers[Tier::Guaranteed.index()].slo = crate::slo::Slo::e2e(1000);
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let sig = |waiting: f64| PoolSignals {
            pressure: Some(60.0),
            queue_depth: Some(waiting),
            queue_time_ms: Some(waiting * 10.0),
            ..Default::default()
        };
        let mut at = 0;
        let mut ctl = None;
        for i in 0..20 {
            at += 500;
            let o = batch(at, Tier::Guaranteed, 1200.0 + f64::from(i % 3) * 50.0, 8);
            let waiting = if i < 10 { 0.0 } else { 2.0 };
            ctl = Some(c.observe(Pool::OnDemand, &rules, &t, &sig(waiting), &o, at));
        }
        let ctl = ctl.unwrap();
        assert!(ctl.unattainable[0], "{ctl:?}");
        assert!(ctl.unloaded_ms[0].is_some_and(|ms| ms >= 1200.0));
        assert_eq!(ctl.level, 0.0, "{ctl:?}");
    }

    /// Headroom is the share of the tier's queueing budget (target less unloaded latency)
    /// left: 1 on an unloaded fleet however close the target is, 0.5 once queueing has added
    /// half of the budget.
    #[test]
    fn headroom_is_measured_against_what_queueing_adds_to_the_unloaded_latency() {
        let rules = PolicyRules::default();
        // The queue's growth is looked at in its own test below.
        let t = AdaptiveTuning {
            queue_lookahead_samples: 0.0,
            ..AdaptiveTuning::default()
        };
        let mut c = PoolController::new();
        let sig = |delay: f64, waiting: f64| PoolSignals {
            pressure: Some(40.0),
            queue_depth: Some(waiting),
            queue_time_ms: Some(delay),
            ..Default::default()
        };
        let mut at = 0;
        let mut ctl = None;
        for _ in 0..10 {
            at += 500;
            let o = batch(at, Tier::Guaranteed, 1150.0, 8);
            ctl = Some(c.observe(Pool::OnDemand, &rules, &t, &sig(0.0, 0.0), &o, at));
        }
        // Guaranteed's target is 2000 ms: the old margin would have read 1 - 1150/2000 = 0.43.
        let h = ctl.unwrap().headroom[0].unwrap();
        assert!((h - 1.0).abs() < 1e-9, "{h}");
        at += 500;
        let o = batch(at, Tier::Guaranteed, 1150.0, 8);
        let ctl = c.observe(Pool::OnDemand, &rules, &t, &sig(425.0, 3.0), &o, at);
        let h = ctl.headroom[0].unwrap();
        assert!((h - 0.5).abs() < 1e-9, "{h}");
    }

    /// A queue whose delay grows is read ahead for Guaranteed, which waits behind everything
    /// in vLLM's FCFS queue: a delay grown from 200 to 400 ms in a sample reads as 800 ms two
    /// samples on, so the level rises a sample earlier than on 400 ms alone.
    #[test]
    fn guaranteed_reads_a_growing_queue_ahead() {
        let rules = PolicyRules::default();
        let run = |lookahead: f64| {
            let t = AdaptiveTuning {
                queue_lookahead_samples: lookahead,
                ..AdaptiveTuning::default()
            };
            let mut c = PoolController::new();
            let sig = |delay: f64| PoolSignals {
                pressure: Some(60.0),
                queue_depth: Some(if delay > 0.0 { 4.0 } else { 0.0 }),
                queue_time_ms: Some(delay),
                ..Default::default()
            };
            let mut at = 0;
            for _ in 0..10 {
                at += 500;
                let o = batch(at, Tier::Guaranteed, 1150.0, 8);
                c.observe(Pool::OnDemand, &rules, &t, &sig(0.0), &o, at);
            }
            for delay in [200.0, 400.0] {
                at += 500;
                let o = batch(at, Tier::Guaranteed, 1150.0, 8);
                c.observe(Pool::OnDemand, &rules, &t, &sig(delay), &o, at);
            }
            c.level()
        };
        assert_eq!(run(0.0), 0.0, "400 ms of a 850 ms budget is no shortfall");
        assert!(run(2.0) > 0.0, "800 ms ahead is");
    }

    #[test]
    fn a_rail_sheds_every_lower_tier_at_once_and_never_guaranteed() {
        let rules = PolicyRules::default();
        let t = tuning();
        let ctl = PoolController::new().observe(Pool::OnDemand, &rules, &t, &kv(100.0), &[], 1000);
        assert_eq!(ctl.rail, Some(RailKind::Pressure));
        assert_eq!(ctl.shares(Tier::BestEffort).shed, 1.0);
        assert_eq!(ctl.shares(Tier::Standard).shed, 1.0);
        assert_eq!(ctl.shares(Tier::Guaranteed), Shares::default());
    }

    /// A nearly full cache puts every cap and brownout in force before any latency is late,
    /// sheds nobody, holds them while it stays full, and lets them go with the latencies once
    /// it is not.
    #[test]
    fn a_nearly_full_cache_shapes_at_once_and_sheds_nobody() {
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        let full = kv(92.0);
        let quick = |at| {
            let mut o = batch(at, Tier::Guaranteed, 200.0, 10);
            o.extend(batch(at, Tier::Standard, 100.0, 10));
            o
        };
        for at in [1000, 5000, 9000] {
            let ctl = c.observe(Pool::OnDemand, &rules, &t, &full, &quick(at), at);
            let std = ctl.shares(Tier::Standard);
            assert_eq!(
                (std.cap, std.brownout, std.fallback, std.shed),
                (1.0, 1.0, 0.0, 0.0)
            );
            assert_eq!(ctl.shares(Tier::BestEffort).shed, 0.0);
            if at == 1000 {
                assert_eq!(ctl.moved, Movement::Shape);
            }
        }
        let ctl = c.observe(
            Pool::OnDemand,
            &rules,
            &t,
            &kv(60.0),
            &quick(13_000),
            13_000,
        );
        assert_eq!(ctl.moved, Movement::Down);
        assert!(ctl.level < shape_floor(&ctl.steps), "{}", ctl.level);
        let off = AdaptiveTuning {
            shape_pressure_at: None,
            ..t
        };
        let ctl =
            PoolController::new().observe(Pool::OnDemand, &rules, &off, &full, &quick(1000), 1000);
        assert_eq!(ctl.level, 0.0, "turned off, KV alone moves nothing");
    }

    /// A pool is filling from `fallback_pressure_at` (70 shipped) on, whatever its level and
    /// traffic; with its KV usage unknown, or the mark off, it is neither (and nothing moves).
    #[test]
    fn a_pool_is_filling_from_the_fallback_mark() {
        let rules = PolicyRules::default();
        let t = tuning();
        let filling = |t: &AdaptiveTuning, signals: &PoolSignals| {
            PoolController::new()
                .observe(Pool::OnDemand, &rules, t, signals, &[], 1000)
                .filling
        };
        assert_eq!(t.fallback_pressure_at, Some(70.0));
        assert_eq!(filling(&t, &kv(69.9)), Some(false));
        assert_eq!(filling(&t, &kv(70.0)), Some(true));
        assert_eq!(filling(&t, &kv(100.0)), Some(true));
        assert_eq!(filling(&t, &PoolSignals::default()), None);
        let off = AdaptiveTuning {
            fallback_pressure_at: None,
            ..t
        };
        assert_eq!(filling(&off, &kv(95.0)), None);
    }

    /// The issue's report: KV steady at 92 % and Standard arriving only now and then. The floor
    /// must not be relaxed away between two of its requests (its steps had no recent traffic),
    /// so every sparse Standard request meets the cap.
    #[test]
    fn the_shaping_floor_holds_for_sparse_traffic() {
        let rules = PolicyRules::default();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let full = PoolSignals {
            pressure: Some(92.0),
            queue_depth: Some(0.0),
            queue_time_ms: Some(0.0),
            ..Default::default()
        };
        let floor = shape_floor(&ladder(&rules, Pool::OnDemand));
        for i in 1..=40u64 {
            let at = i * 500;
            // A Standard request every 5 s, answered quickly a second later.
            let mut o = Vec::new();
            if i % 10 == 0 {
                o.push(Outcome::arrival(at, Tier::Standard));
            }
            if i % 10 == 2 {
                o.push(Outcome::served(at, Tier::Standard, 300.0));
            }
            let ctl = c.observe(Pool::OnDemand, &rules, &t, &full, &o, at);
            assert!(ctl.level >= floor, "sample {i}: {ctl:?}");
            assert_eq!(ctl.shares(Tier::Standard).cap, 1.0, "sample {i}");
        }
    }

    #[test]
    fn steps_of_absent_tiers_are_skipped() {
        // Spot serving only Best-Effort and Standard's fallback traffic: a Standard shortfall
        // goes straight to shedding Best-Effort, past the steps of tiers that are not there.
        let rules = PolicyRules::default();
        let t = tuning();
        let mut c = PoolController::new();
        let mut o = batch(1000, Tier::Standard, 1500.0, 10);
        o.extend(batch(1000, Tier::BestEffort, 200.0, 10));
        let ctl = c.observe(
            Pool::OnDemand,
            &rules,
            &t,
            &PoolSignals::default(),
            &o,
            1000,
        );
        // Standard has traffic, so its cap step is first.
        assert!(ctl.shares(Tier::Standard).cap > 0.0);
        let mut c = PoolController::new();
        let g = batch(1000, Tier::Guaranteed, 3000.0, 10);
        let ctl = c.observe(
            Pool::OnDemand,
            &rules,
            &t,
            &PoolSignals::default(),
            &g,
            1000,
        );
        let first = ctl.steps.len() - 1;
        assert_eq!(ctl.steps[first].tier, Tier::Guaranteed);
        assert_eq!(
            ctl.level,
            (first + 1) as f64,
            "only Guaranteed is here: its cap is the first step that applies"
        );
        assert_eq!(ctl.shares(Tier::Guaranteed).cap, 1.0);
    }

    #[test]
    fn draws_are_uniform_and_deterministic() {
        let n = 10_000;
        let below = (0..n).filter(|i| draw(*i) < 0.3).count();
        assert!((2800..3200).contains(&below), "{below}");
        assert_eq!(draw(42), draw(42));
    }

    /// Every tier judged on TTFT and TPOT only, as the shipped config does.
    fn ttft_tpot_rules() -> PolicyRules {
        let mut rules = PolicyRules::default();
        for (tier, ttft, tpot) in [
            (Tier::Guaranteed, 500, 50),
            (Tier::Standard, 1000, 100),
            (Tier::BestEffort, 2000, 200),
        ] {
            rules.tiers[tier.index()].slo = Slo {
                ttft_ms: Some(ttft),
                tpot_ms: Some(tpot),
                e2e_ms: None,
            };
        }
        rules
    }

    /// `n` streamed answers of `tier` ending at `at` as the proxy reports them: each answer's
    /// first token when it came and, at its end, its pace over 400 tokens. (In a steady flow
    /// the first tokens reported now belong to other answers than the ends; alike here.)
    fn streams(at: Millis, tier: Tier, ttft: f64, tpot: f64, n: usize) -> Vec<Outcome> {
        let latency = ttft + 399.0 * tpot;
        (0..n)
            .flat_map(|_| {
                [
                    Outcome::first_token(at, tier, ttft),
                    Outcome::served(at, tier, latency)
                        .streamed(None, Some(tpot))
                        .with_tokens(Some(400)),
                ]
            })
            .collect()
    }

    /// vLLM's signals: KV usage, waiting requests, queue delay and the pace, `itl` ms a token.
    fn vllm(pressure: f64, waiting: f64, delay: f64, itl: f64) -> PoolSignals {
        PoolSignals {
            pressure: Some(pressure),
            queue_depth: Some(waiting),
            queue_time_ms: Some(delay),
            itl_ms: Some(itl),
            ..Default::default()
        }
    }

    fn queue(pressure: f64, waiting: f64, delay: f64) -> PoolSignals {
        vllm(pressure, waiting, delay, 45.0)
    }

    fn all_tiers(at: Millis, ttft: f64, tpot: f64) -> Vec<Outcome> {
        Tier::ALL
            .into_iter()
            .flat_map(|t| streams(at, t, ttft, tpot, 6))
            .collect()
    }

    #[test]
    fn each_dimension_reads_against_its_own_target() {
        let slo = ttft_tpot_rules().tier(Tier::Guaranteed).slo;
        let whole_stream = Outcome::served(9000, Tier::Guaranteed, 250.0 + 399.0 * 60.0)
            .streamed(Some(250.0), Some(60.0));
        let [ttft, tpot, e2e] = whole_stream.ratios(&slo);
        assert_eq!((ttft, tpot, e2e), (Some(0.5), Some(1.2), None));
        // A capped answer of two tokens is no faster for being short: its first token is late.
        let capped = Outcome::served(9000, Tier::Guaranteed, 710.0)
            .streamed(Some(700.0), Some(10.0))
            .with_tokens(Some(2));
        assert_eq!(capped.ratios(&slo)[0], Some(1.4));
        // A whole answer shows neither its first token nor its pace: vLLM's queue delay and
        // pace speak for it.
        let whole = Outcome::served(9000, Tier::Guaranteed, 6000.0).with_tokens(Some(100));
        assert_eq!(whole.ratios(&slo), [None, None, None]);
        // A stream's first token is reported when it comes; its end then carries its pace.
        let first = Outcome::first_token(9000, Tier::Guaranteed, 300.0);
        assert_eq!(first.ratios(&slo), [Some(0.6), None, None]);
        let end = Outcome::served(9000, Tier::Guaranteed, 8000.0).streamed(None, Some(20.0));
        assert_eq!(end.ratios(&slo), [None, Some(0.4), None]);
        // A running stream bounds its first token by its age until the token comes.
        let waiting = Outcome::pending(9000, Tier::Guaranteed, 800.0).streamed(None, None);
        assert_eq!(waiting.ratios(&slo)[0], Some(1.6));
        let started = Outcome::pending(9000, Tier::Guaranteed, 8000.0).streamed(Some(100.0), None);
        assert_eq!(started.ratios(&slo)[0], None, "reported when it came");
        // A failure misses every dimension set.
        let failed = Outcome::failed(9000, Tier::Guaranteed);
        let inf = Some(f64::INFINITY);
        assert_eq!(failed.ratios(&slo), [inf, inf, None]);
    }

    /// A long answer is not late: with TTFT and TPOT met, 400 tokens taking 20 s leave the
    /// level at 0; vLLM's queue eating the first token's budget raises it.
    #[test]
    fn the_queue_spends_the_first_tokens_budget_not_the_answers_length() {
        let rules = ttft_tpot_rules();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let mut at = 0;
        for _ in 0..12 {
            at += 500;
            let ctl = c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &queue(60.0, 0.0, 0.0),
                &all_tiers(at, 100.0, 45.0),
                at,
            );
            assert_eq!(ctl.level, 0.0, "{ctl:?}");
        }
        let g = c.baseline[0][Dim::Ttft.index()].ms;
        assert!(g.is_some_and(|ms| (ms - 100.0).abs() < 1.0), "{g:?}");
        for _ in 0..4 {
            at += 500;
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &queue(80.0, 12.0, 450.0),
                &all_tiers(at, 550.0, 45.0),
                at,
            );
        }
        assert!(c.level() >= 2.0, "{}", c.level());
    }

    /// A tier's unloaded TTFT is learned from its requests that ran on an empty queue even
    /// when no window holds enough of them (a GPU's seconds-long answers, a tier's low rate),
    /// and never from requests that met a queue.
    #[test]
    fn an_unloaded_first_token_is_learned_across_windows_on_an_empty_queue_only() {
        let rules = ttft_tpot_rules();
        let t = AdaptiveTuning::default();
        let learned = |waiting: f64| {
            let mut c = PoolController::new();
            let mut at = 0;
            for _ in 0..6 {
                // Two answers a sample, the samples further apart than the window.
                at += t.window_ms + 1000;
                let two = streams(at, Tier::Guaranteed, 120.0, 1.0, 2);
                c.observe(
                    Pool::OnDemand,
                    &rules,
                    &t,
                    &queue(20.0, waiting, 0.0),
                    &two,
                    at,
                );
            }
            c.baseline[Tier::Guaranteed.index()][Dim::Ttft.index()].ms
        };
        let g = learned(0.0);
        assert!(g.is_some_and(|ms| (ms - 120.0).abs() < 1.0), "{g:?}");
        assert_eq!(learned(3.0), None);
    }

    /// The batch's pace eating TPOT's budget raises the level with no queue at all (shedding
    /// and capping shrink the batch), the pool is neither calm nor idle meanwhile, and the
    /// level falls once the pace is back.
    #[test]
    fn a_pace_over_budget_is_evidence_without_a_queue() {
        let rules = ttft_tpot_rules();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let mut at = 0;
        for _ in 0..12 {
            at += 500;
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &vllm(30.0, 0.0, 0.0, 20.0),
                &all_tiers(at, 100.0, 20.0),
                at,
            );
        }
        let mut ctl = None;
        for _ in 0..12 {
            at += 500;
            // Guaranteed at 48 ms a token against its 50: 7 % of its (50 − 20) ms budget left.
            ctl = Some(c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &vllm(40.0, 0.0, 0.0, 48.0),
                &all_tiers(at, 100.0, 48.0),
                at,
            ));
        }
        let ctl = ctl.unwrap();
        assert!(!ctl.idle, "{ctl:?}");
        assert!(
            matches!(
                ctl.moved,
                Movement::Up {
                    tier: Tier::Guaranteed,
                    ..
                } | Movement::Hold
            ),
            "{ctl:?}"
        );
        assert!(ctl.level >= 2.0, "{ctl:?}");
        assert_eq!(ctl.shares(Tier::Standard).cap, 1.0, "{ctl:?}");
        let h = ctl.dims[0][Dim::Tpot.index()].headroom;
        assert!(h.is_some_and(|h| h < 0.3), "{h:?}");
        let u = ctl.dims[0][Dim::Tpot.index()].unloaded_ms;
        assert!(
            u.is_some_and(|u| u < 20.1),
            "the slow pace is no new normal: {u:?}"
        );
        // The pace easing is the rise at work: no further rise while it eases.
        let risen = ctl.level;
        for itl in [44.0, 42.0, 40.0, 38.0] {
            at += 500;
            let ctl = c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &vllm(40.0, 0.0, 0.0, itl),
                &all_tiers(at, 100.0, itl),
                at,
            );
            assert!(ctl.level <= risen, "{itl}: {ctl:?}");
        }
        // The pace back at 20 ms: down to 0 within a few seconds, past the hold.
        let mut zero_at = None;
        for _ in 0..16 {
            at += 500;
            let ctl = c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &vllm(30.0, 0.0, 0.0, 20.0),
                &all_tiers(at, 100.0, 20.0),
                at,
            );
            if ctl.level == 0.0 && zero_at.is_none() {
                zero_at = Some(at);
            }
        }
        assert!(zero_at.is_some(), "{}", c.level());
    }

    /// A batch that has spent half of Guaranteed's TPOT budget is busy, though nothing queues
    /// and the cache is under the idle mark: Guaranteed's pool lends no room and takes no moved
    /// answer then. Nothing is shed for it (that waits for `escalate_below`).
    #[test]
    fn a_pace_past_half_the_budget_makes_the_pool_busy_before_it_sheds() {
        let rules = ttft_tpot_rules();
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let mut at = 0;
        let mut at_pace = |c: &mut PoolController, itl: f64| {
            at += 500;
            c.observe(
                Pool::OnDemand,
                &rules,
                &t,
                &vllm(30.0, 0.0, 0.0, itl),
                &all_tiers(at, 100.0, itl),
                at,
            )
        };
        for _ in 0..12 {
            let ctl = at_pace(&mut c, 20.0);
            assert!(!ctl.busy && !ctl.pace_busy, "{ctl:?}");
        }
        // 12 of Guaranteed's (50 − 20) ms spent: 60 % left.
        let ctl = at_pace(&mut c, 32.0);
        assert!(!ctl.busy && !ctl.pace_busy, "{ctl:?}");
        // 17 spent: 43 % left, under half and over `escalate_below`.
        for _ in 0..6 {
            let ctl = at_pace(&mut c, 37.0);
            assert!(ctl.busy && ctl.pace_busy, "{ctl:?}");
            assert_eq!(ctl.level, 0.0, "{ctl:?}");
        }
        let ctl = at_pace(&mut c, 20.0);
        assert!(!ctl.busy && !ctl.pace_busy, "{ctl:?}");
    }

    /// 30 s of a pool decoding at 20 ms a token at an empty cache and 30 ms more at a full one,
    /// its usage cycling from 0 to 30 % with 100 tokens in flight a point; `outcomes` of each
    /// sample by its time and pace. The last control published.
    fn on_a_pace_line(
        c: &mut PoolController,
        pool: Pool,
        rules: &PolicyRules,
        outcomes: impl Fn(Millis, f64) -> Vec<Outcome>,
    ) -> PoolControl {
        let t = AdaptiveTuning::default();
        let mut ctl = None;
        for i in 0..60u64 {
            let at = 500 * (i + 1);
            let usage = (i % 6) as f64 * 0.06;
            let itl = 20.0 + 30.0 * usage;
            let signals = PoolSignals {
                inflight_work: Some(10_000.0 * usage),
                ..vllm(100.0 * usage, 0.0, 0.0, itl)
            };
            ctl = Some(c.observe(pool, rules, &t, &signals, &outcomes(at, itl), at));
        }
        ctl.unwrap()
    }

    /// A pool whose pace grows with its cache publishes, before any tier has run short, the work
    /// at which Guaranteed's TPOT budget would: the pace line is learned from the samples, and
    /// the ceiling scales Sluice's work in flight to the usage that pace needs.
    #[test]
    fn the_pace_line_predicts_the_work_ceiling_before_a_shortage() {
        let rules = ttft_tpot_rules();
        let ctl = on_a_pace_line(
            &mut PoolController::new(),
            Pool::OnDemand,
            &rules,
            |at, itl| all_tiers(at, 100.0, itl),
        );
        // Guaranteed's TPOT target 50 ms over its unloaded 20: short past 20 + 0.7 × 30 = 41 ms,
        // reached at 70 % of the cache, 7,000 tokens.
        let limit = ctl.work_limit.expect("a ceiling");
        let u = ctl.dims[0][Dim::Tpot.index()].unloaded_ms.unwrap();
        let expected = 10_000.0 * (u + 0.7 * (50.0 - u) - 20.0) / 30.0;
        assert!((limit - expected).abs() < 10.0, "{limit} vs {expected}");
        // A pool only Best-Effort uses has nobody above it to keep a ceiling for: a tier is
        // never gated for its own latency.
        let ctl = on_a_pace_line(&mut PoolController::new(), Pool::Spot, &rules, |at, itl| {
            streams(at, Tier::BestEffort, 100.0, itl, 6)
        });
        assert_eq!(ctl.work_limit, None);
        // Standard's fallback answers on spot, whose capacity the fallback model uses, are
        // borrowed: spot's own Best-Effort is not held back for them. Were spot Standard's own
        // pool, it would be.
        let mut rules = ttft_tpot_rules();
        rules.fallback_capacity = FallbackCapacity::On(Pool::Spot);
        // Standard's TPOT budget as Guaranteed's, which this pace line reaches within the cache.
        rules.tiers[Tier::Standard.index()].slo.tpot_ms = Some(50);
        let both = |at: Millis, itl: f64| {
            let mut o = streams(at, Tier::BestEffort, 100.0, itl, 6);
            o.extend(streams(at, Tier::Standard, 100.0, itl, 2));
            o
        };
        let ctl = on_a_pace_line(&mut PoolController::new(), Pool::Spot, &rules, both);
        assert_eq!(ctl.work_limit, None, "no ceiling for borrowed answers");
        rules.tiers[Tier::Standard.index()].preferred_pool = Pool::Spot;
        let ctl = on_a_pace_line(&mut PoolController::new(), Pool::Spot, &rules, both);
        assert!(
            ctl.work_limit.is_some(),
            "Standard's own pool keeps a ceiling for it"
        );
    }

    /// What a pool lends to another pool's tiers is judged for its own, the lowest included:
    /// spot, home to Best-Effort alone, lends up to where its pace would spend half of
    /// Best-Effort's TPOT budget, or its cache would reach the idle mark, whichever comes first.
    #[test]
    fn a_pool_lends_only_what_its_own_tenants_can_spare() {
        let mut rules = ttft_tpot_rules();
        let only_be = |at: Millis, itl: f64| streams(at, Tier::BestEffort, 100.0, itl, 6);
        // Best-Effort's pace budget 40 ms over its unloaded 20: half spent at 40 ms, reached at
        // 67 % of the cache; the idle mark (50 %) comes first, at 5,000 tokens.
        rules.tiers[Tier::BestEffort.index()].slo.tpot_ms = Some(60);
        let ctl = on_a_pace_line(&mut PoolController::new(), Pool::Spot, &rules, only_be);
        let lend = ctl.lend_limit.expect("a lend limit");
        assert!((lend - 5_000.0).abs() < 1.0, "{lend}");
        // A tighter budget, 10 ms over 20: half spent at 25 ms, at 17 % of the cache.
        rules.tiers[Tier::BestEffort.index()].slo.tpot_ms = Some(30);
        let ctl = on_a_pace_line(&mut PoolController::new(), Pool::Spot, &rules, only_be);
        let u = ctl.dims[2][Dim::Tpot.index()].unloaded_ms.unwrap();
        let expected = 10_000.0 * (u + 0.5 * (30.0 - u) - 20.0) / 30.0;
        let lend = ctl.lend_limit.expect("a lend limit");
        assert!(
            lend < 5_000.0 && (lend - expected).abs() < 10.0,
            "{lend} vs {expected}"
        );
        // Without the idle mark and the tiers' budgets, nothing bounds it.
        let t = AdaptiveTuning {
            idle_pressure_below: None,
            ..Default::default()
        };
        let open = PolicyRules::default();
        let mut c = PoolController::new();
        let mut ctl = None;
        for i in 0..60u64 {
            let usage = (i % 6) as f64 * 0.06;
            let signals = PoolSignals {
                inflight_work: Some(10_000.0 * usage),
                ..vllm(100.0 * usage, 0.0, 0.0, 20.0 + 30.0 * usage)
            };
            let at = 500 * (i + 1);
            ctl = Some(c.observe(Pool::Spot, &open, &t, &signals, &[], at));
        }
        assert_eq!(ctl.unwrap().lend_limit, None);
    }

    /// Without streamed answers of its own a tier reads vLLM's pace (the batch decodes every
    /// request at one pace), and a TPOT target under the pool's unloaded pace is flagged on
    /// that dimension alone: the tier's TTFT still protects it, its TPOT sheds nobody.
    #[test]
    fn vllm_pace_stands_in_and_an_unreachable_pace_is_flagged_alone() {
        let mut rules = ttft_tpot_rules();
        rules.tiers[Tier::Standard.index()].slo.tpot_ms = Some(15);
        let t = AdaptiveTuning::default();
        let mut c = PoolController::new();
        let whole = |at: Millis| -> Vec<Outcome> {
            Tier::ALL
                .into_iter()
                .flat_map(|tier| {
                    (0..6).map(move |_| {
                        Outcome::served(at, tier, 200.0 + 99.0 * 20.0).with_tokens(Some(100))
                    })
                })
                .collect()
        };
        let paced = |itl: f64| PoolSignals {
            itl_ms: Some(itl),
            ..queue(30.0, 0.0, 0.0)
        };
        let mut at = 0;
        let mut ctl = None;
        for _ in 0..12 {
            at += 500;
            ctl = Some(c.observe(Pool::OnDemand, &rules, &t, &paced(20.0), &whole(at), at));
        }
        let ctl = ctl.unwrap();
        let g = &ctl.dims[0][Dim::Tpot.index()];
        assert_eq!(g.unloaded_ms, Some(20.0), "{g:?}");
        assert!(g.headroom.is_some_and(|h| h > 0.9), "{g:?}");
        let s = &ctl.dims[1];
        assert!(s[Dim::Tpot.index()].unattainable, "{s:?}");
        assert!(!s[Dim::Ttft.index()].unattainable, "{s:?}");
        assert!(!ctl.unattainable[1]);
        assert_eq!(
            ctl.level, 0.0,
            "Standard's unreachable pace sheds nobody: {ctl:?}"
        );
    }
}
