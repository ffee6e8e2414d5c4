//! What a decision record carries so the policy can decide it again: the request's facts, the
//! parts of the published [`PolicyState`] that `policy::decide` reads, the policy's own answer,
//! and fingerprints of the rules that built the parts of that state which depend on history
//! (the stabilised tier states, the sustained-pressure tracker, the adaptive controllers).
//!
//! Captured on the request path, so it is `Copy` and holds no heap data: a few numbers and
//! enum codes. Serialised only when the record is written (log line, ledger batch, spool).

use serde::{Deserialize, Deserializer, Serialize};
use sluice_policy::adaptive::{rail_level, rail_of, Step};
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::Clock;
use sluice_policy::{
    pressure, Decision, PolicyMode, PolicyState, Pool, PoolSignals, PressureState, Reason,
    RequestFacts, SignalKind, Tier, TierState,
};

/// The format written now; replay skips records of another version (and says how many).
/// Version 2 added each pool's `busy` and `lend_limit`; version 1 records read as not busy,
/// with no lend limit (their rows were written while nothing read them).
pub const VERSION: u8 = 2;

/// Whether records of version `v` are read: this one, and the one before it, which only lacks
/// fields that read as their defaults.
pub fn readable(v: u8) -> bool {
    v == VERSION || v == 1
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyInputs {
    pub v: u8,
    /// The mode of the rules the decision was made under.
    #[serde(with = "code")]
    pub mode: PolicyMode,
    /// The policy sample the decision read, on the replica's policy clock (ms since its start).
    pub sample_ms: u64,
    /// Unix ms when that clock read zero: tells two lifetimes of one replica name apart, whose
    /// policy clocks both start at zero.
    pub epoch_ms: u64,
    pub facts: Facts,
    /// Thresholds mode's reading of the request's tier.
    pub tier_state: TierRead,
    pub fallback_active: bool,
    /// On-demand then spot: their signals and their adaptive controllers' published control.
    pub pools: [PoolRead; 2],
    pub rules: RulesFingerprint,
    /// The policy's own answer (the record's `decision` and `reason` may be admission's).
    pub decided: Decided,
}

/// [`RequestFacts`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Facts {
    /// The tier the policy judged (a demoted tenant's is not its own).
    #[serde(with = "code")]
    pub tier: Tier,
    pub shapeable: bool,
    pub fallback_available: bool,
    pub spot_healthy: bool,
    #[serde(with = "opt_code", default, skip_serializing_if = "Option::is_none")]
    pub fallback_pool: Option<Pool>,
    pub ticket: u64,
    pub prompt_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    pub inflight_work: [f64; 2],
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TierRead {
    #[serde(with = "code")]
    pub state: PressureState,
    #[serde(with = "code")]
    pub driver: SignalKind,
    pub fail_open: bool,
    pub pressure_unavailable: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PoolRead {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pressure: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sla_violation_rate: Option<f64>,
    pub level: f64,
    pub saturated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_limit: Option<f64>,
    /// The controller's busy reading: what lending Guaranteed's pool and its overflow read.
    #[serde(default)]
    pub busy: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lend_limit: Option<f64>,
}

impl PoolRead {
    /// The signals thresholds mode and the rails read (the controller's delay inputs are not
    /// replayed: its level is).
    pub fn signals(&self) -> PoolSignals {
        PoolSignals {
            pressure: self.pressure,
            queue_depth: self.queue_depth,
            sla_violation_rate: self.sla_violation_rate,
            ..Default::default()
        }
    }
}

/// Hashes of the rules behind the history-dependent parts of the state. Equal hashes mean the
/// recorded part is what the candidate's rules would have built, so replay uses it as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesFingerprint {
    /// Mode, the request tier's thresholds and the stability tuning.
    pub tier: u32,
    /// The sustained-pressure tracker's tuning.
    pub fallback: u32,
    /// What moves an adaptive controller's level: its knobs, targets and ladder.
    pub controller: u32,
}

/// The intervention without its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    Pass,
    Degrade,
    Fallback,
    Reject,
}

impl ActionKind {
    pub const ALL: [ActionKind; 4] = [
        ActionKind::Pass,
        ActionKind::Degrade,
        ActionKind::Fallback,
        ActionKind::Reject,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Pass => "pass",
            ActionKind::Degrade => "degrade",
            ActionKind::Fallback => "fallback",
            ActionKind::Reject => "reject",
        }
    }

    /// Whether the request is sent to a backend at all.
    pub fn serves(self) -> bool {
        self != ActionKind::Reject
    }
}

/// One decision of the policy, as compared by replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    #[serde(with = "code")]
    pub action: ActionKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    #[serde(with = "code")]
    pub reason: Reason,
    #[serde(with = "code")]
    pub pool: Pool,
}

impl Decided {
    pub fn of(d: &Decision) -> Self {
        let action = match d.action {
            sluice_policy::Action::Pass => ActionKind::Pass,
            sluice_policy::Action::Degrade { .. } => ActionKind::Degrade,
            sluice_policy::Action::Fallback { .. } => ActionKind::Fallback,
            sluice_policy::Action::Reject => ActionKind::Reject,
        };
        Decided {
            action,
            cap: d.action.max_tokens_cap(),
            reason: d.reason,
            pool: d.pool,
        }
    }

    /// Same intervention on the same pool; the reason may differ.
    pub fn same_effect(&self, other: &Decided) -> bool {
        (self.action, self.cap, self.pool) == (other.action, other.cap, other.pool)
    }
}

/// Unix ms when this process's policy clock read zero. Computed once: the clock is monotonic,
/// so the value only names the process lifetime and need not be exact.
fn epoch_ms(clock: Clock) -> u64 {
    static EPOCH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(|| {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        wall.saturating_sub(clock.now_ms())
    })
}

/// JSON has no NaN or infinity: a non-finite number would make the record unreadable.
fn finite(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

fn finite_opt(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

impl PolicyInputs {
    /// What `decision` was decided on. Cheap: copies and three short hashes, no allocation.
    pub fn capture(
        state: &PolicyState,
        rules: &PolicyRules,
        facts: &RequestFacts,
        decision: &Decision,
        clock: Clock,
    ) -> Self {
        let t = state.tier(facts.tier);
        let pool = |i: usize, s: &PoolSignals| {
            let c = &state.pools[i];
            PoolRead {
                pressure: finite_opt(s.pressure),
                queue_depth: finite_opt(s.queue_depth),
                sla_violation_rate: finite_opt(s.sla_violation_rate),
                level: finite(c.level),
                saturated: c.saturated,
                work_limit: finite_opt(c.work_limit),
                busy: c.busy,
                lend_limit: finite_opt(c.lend_limit),
            }
        };
        PolicyInputs {
            v: VERSION,
            mode: rules.mode,
            sample_ms: state.at,
            epoch_ms: epoch_ms(clock),
            facts: Facts {
                tier: facts.tier,
                shapeable: facts.shapeable,
                fallback_available: facts.fallback_available,
                spot_healthy: facts.spot_healthy,
                fallback_pool: facts.fallback_pool,
                ticket: facts.ticket,
                prompt_tokens: facts.prompt_tokens,
                max_tokens: facts.max_tokens,
                inflight_work: facts.inflight_work.map(finite),
            },
            tier_state: TierRead {
                state: t.state,
                driver: t.driver,
                fail_open: t.fail_open,
                pressure_unavailable: t.pressure_unavailable,
            },
            fallback_active: state.fallback_active,
            pools: [pool(0, &state.signals), pool(1, &state.spot_signals)],
            rules: fingerprint(rules, facts.tier),
            decided: Decided::of(decision),
        }
    }

    pub fn request_facts(&self) -> RequestFacts {
        let f = &self.facts;
        RequestFacts {
            tier: f.tier,
            shapeable: f.shapeable,
            fallback_available: f.fallback_available,
            spot_healthy: f.spot_healthy,
            fallback_pool: f.fallback_pool,
            ticket: f.ticket,
            prompt_tokens: f.prompt_tokens,
            max_tokens: f.max_tokens,
            inflight_work: f.inflight_work,
        }
    }

    /// Fills `state` with what `rules` (the candidate's) would have published at this record's
    /// sample, for this request. `tier_state` and `fallback_active` are the thresholds
    /// parts to use (the recorded ones when the rules behind them match, see
    /// [`RulesFingerprint`]); `ladders` are `rules`' ladders per pool.
    ///
    /// Adaptive control is the recorded level on the candidate's ladder, as a hot reload would
    /// find it: the controller is not re-run. Rails depend only on the sample's signals, so they
    /// are checked again with the candidate's rail thresholds.
    pub fn fill_state(
        &self,
        state: &mut PolicyState,
        rules: &PolicyRules,
        ladders: &[Vec<Step>; 2],
        tier_state: TierState,
        fallback_active: bool,
    ) {
        let od = self.pools[0].signals();
        let spot = self.pools[1].signals();
        state.tiers[tier_state.tier.index()] = tier_state;
        state.fallback_active = fallback_active;
        state.spot_state =
            pressure::evaluate(&rules.spot_eviction, &spot, &rules.stability).escalate;
        for (i, ctl) in state.pools.iter_mut().enumerate() {
            let read = &self.pools[i];
            let steps = &ladders[i];
            // One controller governs both pools when spot lists on-demand's backends.
            let signals = if rules.spot_is_on_demand || i == 0 {
                &od
            } else {
                &spot
            };
            let rail = rail_of(&rules.adaptive, signals);
            let mut level = read.level.min(steps.len() as f64);
            if rail.is_some() {
                level = level.max(rail_level(steps));
            }
            // Only what `decide` reads; `clone_from` reuses the template's allocation.
            ctl.steps.clone_from(steps);
            ctl.level = level;
            ctl.rail = rail;
            ctl.saturated = read.saturated;
            ctl.work_limit = read.work_limit;
            ctl.busy = read.busy;
            ctl.lend_limit = read.lend_limit;
        }
        state.signals = od;
        state.spot_signals = spot;
        state.at = self.sample_ms;
    }

    /// The recorded thresholds reading of the request's tier.
    pub fn tier_state(&self) -> TierState {
        let t = &self.tier_state;
        TierState {
            tier: self.facts.tier,
            state: t.state,
            driver: t.driver,
            fail_open: t.fail_open,
            pressure_unavailable: t.pressure_unavailable,
        }
    }
}

/// A word-at-a-time hash (FxHash's step, splitmix64's finaliser): defined here, so stable
/// across builds and platforms as a value stored in the ledger and compared by a later binary
/// must be (Rust's own hasher is not), and one multiply per word because it runs per request.
struct Hash(u64);

impl Hash {
    fn new() -> Self {
        Hash(0xcbf2_9ce4_8422_2325)
    }

    fn word(&mut self, w: u64) -> &mut Self {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
        self
    }

    fn f(&mut self, v: f64) -> &mut Self {
        self.word(v.to_bits())
    }

    fn opt(&mut self, v: Option<f64>) -> &mut Self {
        match v {
            Some(v) => self.word(1).f(v),
            None => self.word(0),
        }
    }

    fn thresholds(&mut self, t: &pressure::Thresholds) -> &mut Self {
        for s in [&t.pressure, &t.queue_depth, &t.sla_violation_rate] {
            self.opt(s.elevated_at).opt(s.critical_at);
        }
        self
    }

    fn finish(&self) -> u32 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z ^ (z >> 32)) as u32
    }
}

fn pool_code(p: Pool) -> u64 {
    match p {
        Pool::OnDemand => 0,
        Pool::Spot => 1,
        Pool::Fallback => 2,
    }
}

/// The fingerprints of `rules` for a request of `tier`.
pub fn fingerprint(rules: &PolicyRules, tier: Tier) -> RulesFingerprint {
    let s = &rules.stability;
    let mut h = Hash::new();
    h.word(rules.mode as u64)
        .thresholds(&rules.tier(tier).thresholds)
        .word(u64::from(s.consecutive_samples))
        .word(s.cooldown_ms)
        .f(s.hysteresis)
        .f(s.queue_depth_hysteresis)
        .f(s.sla_rate_hysteresis);
    let tier_fp = h.finish();

    let f = &rules.fallback;
    let mut h = Hash::new();
    h.f(f.pressure_at)
        .f(f.recover_below)
        .word(u64::from(f.sustained_intervals))
        .word(f.cooldown_ms);
    let fallback = h.finish();

    let a = &rules.adaptive;
    let mut h = Hash::new();
    h.word(a.window_ms)
        .f(a.quantile)
        .word(a.min_samples as u64)
        .f(a.escalate_below)
        .f(a.relax_above)
        .f(a.max_step_up)
        .f(a.min_step_up)
        .f(a.step_down)
        .word(a.hold_ms)
        .opt(a.rail_pressure_at)
        .opt(a.rail_queue_depth_at)
        .opt(a.shape_pressure_at)
        .opt(a.fallback_pressure_at)
        .word(u64::from(a.reserves_guaranteed_pool()))
        .opt(a.reserve_ttft_below_x)
        .word(u64::from(a.work_gate))
        .f(a.work_share_standard)
        .f(a.work_share_best_effort)
        .word(a.assumed_max_tokens)
        .f(a.rise_gain)
        .word(u64::from(a.lead))
        .opt(a.idle_pressure_below)
        .word(a.idle_release_ms)
        .word(a.baseline_half_life_ms)
        .f(a.queue_lookahead_samples)
        .word(u64::from(rules.spot_is_on_demand));
    // Hashed only when on, so records made before the knob existed still match their rules.
    if a.guaranteed_overflow_to_spot {
        h.word(u64::MAX - 1);
    }
    match rules.fallback_capacity {
        sluice_policy::tenant_policy::FallbackCapacity::None => h.word(0),
        sluice_policy::tenant_policy::FallbackCapacity::Separate => h.word(1),
        sluice_policy::tenant_policy::FallbackCapacity::On(p) => h.word(2 + pool_code(p)),
    };
    for t in &rules.tiers {
        // An end-to-end-only objective hashes as the prototype's target did, so records made
        // before TTFT and TPOT existed still match their rules.
        if t.slo.ttft_ms.is_some() || t.slo.tpot_ms.is_some() {
            h.word(u64::MAX)
                .word(t.slo.ttft_ms.map_or(0, |v| v + 1))
                .word(t.slo.tpot_ms.map_or(0, |v| v + 1));
        }
        h.word(t.slo.e2e_ms.unwrap_or(0))
            .word(t.max_tokens_cap.map_or(0, |c| u64::from(c) + 1))
            .word(t.brownout_max_tokens.map_or(0, |c| u64::from(c) + 1))
            .word(u64::from(t.fallback_eligible))
            .word(pool_code(t.preferred_pool));
    }
    RulesFingerprint {
        tier: tier_fp,
        fallback,
        controller: h.finish(),
    }
}

/// Enums stored by their stable string codes (the same strings as headers, logs and metrics).
pub trait Code: Copy + 'static {
    fn all() -> &'static [Self];
    fn code(self) -> &'static str;
}

impl Code for Pool {
    fn all() -> &'static [Self] {
        &[Pool::OnDemand, Pool::Spot, Pool::Fallback]
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for PressureState {
    fn all() -> &'static [Self] {
        &[
            PressureState::Normal,
            PressureState::Elevated,
            PressureState::Critical,
        ]
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for SignalKind {
    fn all() -> &'static [Self] {
        &[
            SignalKind::Pressure,
            SignalKind::QueueDepth,
            SignalKind::SlaViolationRate,
        ]
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for Tier {
    fn all() -> &'static [Self] {
        &Tier::ALL
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for PolicyMode {
    fn all() -> &'static [Self] {
        &[PolicyMode::Thresholds, PolicyMode::Adaptive]
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for Reason {
    fn all() -> &'static [Self] {
        Reason::ALL
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

impl Code for ActionKind {
    fn all() -> &'static [Self] {
        &ActionKind::ALL
    }
    fn code(self) -> &'static str {
        self.as_str()
    }
}

pub fn parse_code<T: Code>(s: &str) -> Option<T> {
    T::all().iter().copied().find(|v| v.code() == s)
}

mod code {
    use super::{parse_code, Code};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Code, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.code())
    }

    pub fn deserialize<'de, T: Code, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        parse_code(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown code {s:?}")))
    }
}

mod opt_code {
    use super::{parse_code, Code};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Code, S: Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(v.code()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, T: Code, D: Deserializer<'de>>(d: D) -> Result<Option<T>, D::Error> {
        let s = Option::<std::borrow::Cow<str>>::deserialize(d)?;
        s.map(|s| {
            parse_code(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown code {s:?}")))
        })
        .transpose()
    }
}

/// Reads a record's `inputs` leniently: inputs this build cannot read (another format) leave
/// the record without them instead of making the whole record unreadable, which would lose it
/// from the spool.
pub fn lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyInputs>, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(v.and_then(|v| serde_json::from_value(v).ok()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sluice_policy::{Action, PolicyEngine};

    /// Inputs with the awkward values: a level that is not a short decimal, a tiny float, a
    /// NaN, a ticket near `u64::MAX` (shared with `json_line`'s tests).
    pub(crate) fn sample() -> (PolicyInputs, Decision) {
        let rules = PolicyRules::default();
        let mut engine = PolicyEngine::new(rules.clone());
        let sig = PoolSignals {
            pressure: Some(71.3),
            queue_depth: Some(3.0),
            ..Default::default()
        };
        let mut state = engine.observe(&sig, &PoolSignals::default(), 1234);
        state.pools[0].level = 2.4000000000000004;
        state.pools[1].work_limit = Some(1e-7);
        let facts = RequestFacts {
            tier: Tier::Standard,
            shapeable: true,
            fallback_available: true,
            spot_healthy: false,
            fallback_pool: Some(Pool::Spot),
            ticket: u64::MAX - 3,
            prompt_tokens: 12,
            max_tokens: Some(400),
            inflight_work: [1.5, f64::NAN],
        };
        let d = sluice_policy::decide(&state, &rules, &facts);
        let inputs = PolicyInputs::capture(&state, &rules, &facts, &d, Clock::new());
        (inputs, d)
    }

    #[test]
    fn inputs_round_trip_through_json_exactly() {
        let (inputs, d) = sample();
        let text = serde_json::to_string(&inputs).unwrap();
        let back: PolicyInputs = serde_json::from_str(&text).unwrap();
        assert_eq!(back, inputs, "{text}");
        assert_eq!(back.facts.inflight_work, [1.5, 0.0], "NaN stored as 0");
        assert_eq!(back.pools[0].level, 2.4000000000000004);
        assert_eq!(back.decided, Decided::of(&d));
        assert_eq!(
            Decided::of(&Decision {
                action: Action::Degrade { max_tokens: 256 },
                ..d
            })
            .cap,
            Some(256)
        );
    }

    #[test]
    fn fingerprints_follow_only_the_rules_behind_each_part() {
        let rules = PolicyRules::default();
        let base = fingerprint(&rules, Tier::BestEffort);
        assert_eq!(base, fingerprint(&rules.clone(), Tier::BestEffort));
        let mut r = rules.clone();
        r.tiers[Tier::Standard.index()]
            .thresholds
            .pressure
            .critical_at = Some(80.0);
        assert_eq!(
            fingerprint(&r, Tier::BestEffort).tier,
            base.tier,
            "another tier's thresholds"
        );
        assert_ne!(
            fingerprint(&r, Tier::Standard).tier,
            fingerprint(&rules, Tier::Standard).tier
        );
        r.mode = PolicyMode::Thresholds;
        assert_ne!(fingerprint(&r, Tier::BestEffort).tier, base.tier, "mode");
        let mut r = rules.clone();
        r.fallback.sustained_intervals = 5;
        let fp = fingerprint(&r, Tier::BestEffort);
        assert_eq!((fp.tier, fp.controller), (base.tier, base.controller));
        assert_ne!(fp.fallback, base.fallback);
        // Every knob that moves the level, and each tier's caps (they shape the ladder).
        let changed: [fn(&mut PolicyRules); 5] = [
            |r| r.adaptive.escalate_below = 0.4,
            |r| r.adaptive.rise_gain = 2.0,
            |r| r.adaptive.lead = false,
            |r| r.adaptive.idle_pressure_below = None,
            |r| r.tiers[Tier::Standard.index()].brownout_max_tokens = None,
        ];
        for (i, change) in changed.iter().enumerate() {
            let mut r = rules.clone();
            change(&mut r);
            let fp = fingerprint(&r, Tier::BestEffort);
            assert_ne!(fp.controller, base.controller, "change {i}");
        }
    }

    #[test]
    fn unreadable_inputs_leave_the_record_readable() {
        #[derive(Deserialize)]
        struct R {
            #[serde(default, deserialize_with = "lenient")]
            inputs: Option<PolicyInputs>,
        }
        let r: R = serde_json::from_str(r#"{"inputs": {"v": 9, "what": 1}}"#).unwrap();
        assert!(r.inputs.is_none());
        let r: R = serde_json::from_str(r#"{}"#).unwrap();
        assert!(r.inputs.is_none());
    }
}
