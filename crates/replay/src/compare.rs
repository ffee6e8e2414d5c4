//! Deciding recorded requests again under a candidate's rules, and what changes. Pure: the
//! items in, outcomes and summaries out.
//!
//! The state each request is decided on is rebuilt from its record ([`PolicyInputs`]): its
//! facts as recorded; in thresholds mode its tier's state and the fallback tracker as recorded
//! when the candidate's rules behind them are the recorded ones, else rebuilt from the
//! recorded samples ([`super::rederive`]); in adaptive mode each pool's recorded admission
//! level on the candidate's ladder, rails checked again against the recorded signals.
//! Same inputs and same rules give the same decision, so a replay with the config in force
//! changes nothing.

use super::estimate::Estimator;
use super::rederive::Rederived;
use super::source::Item;
use serde::Serialize;
use sluice_policy::adaptive::ladder;
use sluice_policy::tenant_policy::{FallbackCapacity, PolicyRules};
use sluice_policy::{PolicyMode, PolicyState, Pool, Tier};
use sluice_record::inputs::{fingerprint, ActionKind, Decided, PolicyInputs};
use std::collections::BTreeMap;

/// What happened to a request, as recorded or as estimated under the candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Served within its tier's target.
    OnTime,
    Late,
    /// Refused by the policy.
    Refused,
    /// Admitted by the policy, then not served (capacity, queue, backend error, client gone).
    NotServed,
    /// Served, but no latency estimate is possible.
    Unknown,
}

impl Fate {
    pub fn as_str(self) -> &'static str {
        match self {
            Fate::OnTime => "on time",
            Fate::Late => "late",
            Fate::Refused => "refused",
            Fate::NotServed => "not served",
            Fate::Unknown => "unknown",
        }
    }
}

/// One request decided again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub recorded: Decided,
    pub replayed: Decided,
    pub recorded_fate: Fate,
    pub replayed_fate: Fate,
    /// The borrowed latency when the candidate serves the request differently.
    pub estimated_ms: Option<f64>,
}

impl Outcome {
    pub fn changed(&self) -> bool {
        !self.recorded.same_effect(&self.replayed)
    }
}

/// How the state behind the replayed decisions was obtained, for the report to say plainly.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Notes {
    /// Decisions per recorded mode.
    pub recorded_modes: BTreeMap<&'static str, u64>,
    /// Thresholds candidate: decisions whose tier state was the recorded one / rebuilt.
    pub tier_state_recorded: u64,
    pub tier_state_rebuilt: u64,
    /// Thresholds candidate: decisions whose fallback tracker was rebuilt.
    pub fallback_rebuilt: u64,
    /// Recorded samples the candidate's engine was run over (0 when nothing was rebuilt).
    pub samples_rebuilt: usize,
    /// Adaptive candidate: decisions recorded under other controller knobs, targets or ladder
    /// than the candidate's (their recorded level is used all the same).
    pub level_under_other_knobs: u64,
}

pub struct Replay {
    pub outcomes: Vec<Outcome>,
    pub notes: Notes,
}

fn fate_of(served: Option<super::source::Served>, refused: bool) -> Fate {
    match served {
        Some(s) if s.violated => Fate::Late,
        Some(_) => Fate::OnTime,
        None if refused => Fate::Refused,
        None => Fate::NotServed,
    }
}

/// Decides every item (in arrival order) again with `rules`.
pub fn replay(items: &[Item], rules: &PolicyRules) -> Replay {
    let ladders = [ladder(rules, Pool::OnDemand), ladder(rules, Pool::Spot)];
    let fps = Tier::ALL.map(|t| fingerprint(rules, t));
    let thresholds = rules.mode == PolicyMode::Thresholds;
    let stale = |it: &Item| {
        let (fp, rec) = (&fps[it.tier.index()], &it.inputs.rules);
        (fp.tier != rec.tier, fp.fallback != rec.fallback)
    };
    let rebuilt = (thresholds && items.iter().any(|it| stale(it) != (false, false)))
        .then(|| Rederived::run(items, rules));
    let estimator = Estimator::new(items);
    let mut notes = Notes {
        samples_rebuilt: rebuilt.as_ref().map_or(0, Rederived::samples),
        ..Default::default()
    };
    let mut state = PolicyState {
        pools: ladders
            .clone()
            .map(sluice_policy::adaptive::PoolControl::idle),
        ..PolicyState::initial()
    };
    let outcomes = items
        .iter()
        .map(|it| {
            let rec: &PolicyInputs = &it.inputs;
            *notes.recorded_modes.entry(rec.mode.as_str()).or_default() += 1;
            let (mut tier_state, mut fallback_active) = (rec.tier_state(), rec.fallback_active);
            if thresholds {
                let (tier_stale, fallback_stale) = stale(it);
                let again = rebuilt.as_ref().and_then(|r| r.at(it));
                match again.filter(|_| tier_stale) {
                    Some(s) => {
                        tier_state = s.tiers[it.tier.index()];
                        notes.tier_state_rebuilt += 1;
                    }
                    None => notes.tier_state_recorded += 1,
                }
                if let Some(s) = again.filter(|_| fallback_stale) {
                    fallback_active = s.fallback_active;
                    notes.fallback_rebuilt += 1;
                }
            } else if fps[it.tier.index()].controller != rec.rules.controller {
                notes.level_under_other_knobs += 1;
            }
            rec.fill_state(&mut state, rules, &ladders, tier_state, fallback_active);
            let mut facts = rec.request_facts();
            // Without fallbacks in the candidate there is none to be usable; one it adds has no
            // recorded health, so a recorded "none usable" stands.
            if rules.fallback_capacity == FallbackCapacity::None {
                facts.fallback_available = false;
                facts.fallback_pool = None;
            }
            let d = sluice_policy::decide(&state, rules, &facts);
            let replayed = Decided::of(&d);
            judge(it, rec.decided, replayed, rules, &estimator)
        })
        .collect();
    Replay { outcomes, notes }
}

/// The recorded and the estimated fate of one request (see [`super::estimate`]).
fn judge(
    it: &Item,
    recorded: Decided,
    replayed: Decided,
    rules: &PolicyRules,
    estimator: &Estimator,
) -> Outcome {
    let recorded_fate = fate_of(it.served, recorded.action == ActionKind::Reject);
    let target = rules.tier(it.tier).slo.e2e_ms.unwrap_or(u64::MAX);
    // The logging phase's rule: whole milliseconds over the target.
    let verdict = |ms: f64| {
        if (ms.max(0.0).floor() as u64) > target {
            Fate::Late
        } else {
            Fate::OnTime
        }
    };
    let mut estimated_ms = None;
    let replayed_fate = if !replayed.action.serves() {
        Fate::Refused
    } else if recorded.same_effect(&replayed) {
        match it.served {
            Some(s) if it.sla_target_ms == Some(target) && target != u64::MAX => {
                fate_of(Some(s), false)
            }
            Some(s) => verdict(s.latency_ms),
            None => recorded_fate,
        }
    } else if recorded_fate == Fate::NotServed {
        // Capacity and backends are not replayed: what kept it from being served still would.
        Fate::NotServed
    } else {
        estimated_ms =
            estimator.estimate(it.tier, replayed.pool, replayed.action, it.received_at_ms);
        estimated_ms.map_or(Fate::Unknown, verdict)
    };
    Outcome {
        recorded,
        replayed,
        recorded_fate,
        replayed_fate,
        estimated_ms,
    }
}

/// Decisions per action.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Actions {
    pub pass: u64,
    pub degrade: u64,
    pub fallback: u64,
    pub reject: u64,
}

impl Actions {
    fn add(&mut self, a: ActionKind) {
        *match a {
            ActionKind::Pass => &mut self.pass,
            ActionKind::Degrade => &mut self.degrade,
            ActionKind::Fallback => &mut self.fallback,
            ActionKind::Reject => &mut self.reject,
        } += 1;
    }
}

/// Requests per fate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Fates {
    pub on_time: u64,
    pub late: u64,
    pub refused: u64,
    pub not_served: u64,
    pub unknown: u64,
}

impl Fates {
    fn add(&mut self, f: Fate) {
        *match f {
            Fate::OnTime => &mut self.on_time,
            Fate::Late => &mut self.late,
            Fate::Refused => &mut self.refused,
            Fate::NotServed => &mut self.not_served,
            Fate::Unknown => &mut self.unknown,
        } += 1;
    }
}

/// The SLA effect of the changed decisions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sla {
    pub recorded: Fates,
    pub estimated: Fates,
    /// Served late, now refused: a late answer turned into a refusal.
    pub late_to_refused: u64,
    /// Served on time, now refused: an answer lost.
    pub on_time_to_refused: u64,
    /// Refused, now served: estimated on time / late / unknown.
    pub refused_to_on_time: u64,
    pub refused_to_late: u64,
    pub refused_to_unknown: u64,
    /// Served either way, but differently (capped, moved, uncapped): late before, on time now
    /// and the other way round.
    pub late_to_on_time: u64,
    pub on_time_to_late: u64,
}

/// One group's (a tier's, a tenant's, everything's) comparison.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    pub decisions: u64,
    /// Another action, cap or pool.
    pub changed: u64,
    /// The same action, cap and pool for another reason.
    pub reason_only: u64,
    pub recorded: Actions,
    pub candidate: Actions,
    /// `from->to` for changed decisions.
    pub transitions: BTreeMap<String, u64>,
    pub sla: Sla,
}

impl Summary {
    pub fn add(&mut self, o: &Outcome) {
        self.decisions += 1;
        self.recorded.add(o.recorded.action);
        self.candidate.add(o.replayed.action);
        self.sla.recorded.add(o.recorded_fate);
        self.sla.estimated.add(o.replayed_fate);
        if !o.changed() {
            self.reason_only += u64::from(o.recorded.reason != o.replayed.reason);
            return;
        }
        self.changed += 1;
        let key = format!(
            "{}->{}",
            o.recorded.action.as_str(),
            o.replayed.action.as_str()
        );
        *self.transitions.entry(key).or_default() += 1;
        let s = &mut self.sla;
        match (o.recorded_fate, o.replayed_fate) {
            (Fate::Late, Fate::Refused) => s.late_to_refused += 1,
            (Fate::OnTime, Fate::Refused) => s.on_time_to_refused += 1,
            (Fate::Refused, Fate::OnTime) => s.refused_to_on_time += 1,
            (Fate::Refused, Fate::Late) => s.refused_to_late += 1,
            (Fate::Refused, Fate::Unknown) => s.refused_to_unknown += 1,
            (Fate::Late, Fate::OnTime) => s.late_to_on_time += 1,
            (Fate::OnTime, Fate::Late) => s.on_time_to_late += 1,
            _ => {}
        }
    }

    /// Candidate minus recorded: refusals, caps, fallbacks.
    pub fn deltas(&self) -> (i64, i64, i64) {
        let d = |a: u64, b: u64| b as i64 - a as i64;
        (
            d(self.recorded.reject, self.candidate.reject),
            d(self.recorded.degrade, self.candidate.degrade),
            d(self.recorded.fallback, self.candidate.fallback),
        )
    }
}

/// Summaries per tier, per tenant and overall.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summaries {
    pub total: Summary,
    pub tiers: BTreeMap<&'static str, Summary>,
    pub tenants: BTreeMap<String, Summary>,
}

pub fn summarise(items: &[Item], outcomes: &[Outcome]) -> Summaries {
    let mut s = Summaries::default();
    for t in Tier::ALL {
        s.tiers.insert(t.as_str(), Summary::default());
    }
    for (it, o) in items.iter().zip(outcomes) {
        s.total.add(o);
        s.tiers.entry(it.tier.as_str()).or_default().add(o);
        match s.tenants.get_mut(&it.tenant) {
            Some(t) => t.add(o),
            None => {
                let mut t = Summary::default();
                t.add(o);
                s.tenants.insert(it.tenant.clone(), t);
            }
        }
    }
    s
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::source::Served;
    use super::*;
    use sluice_policy::adaptive::Outcome as Heard;
    use sluice_policy::Clock;
    use sluice_policy::{PolicyEngine, PoolSignals, RequestFacts};
    use sluice_record::inputs::PolicyInputs;

    fn facts(tier: Tier, ticket: u64) -> RequestFacts {
        RequestFacts {
            tier,
            shapeable: true,
            fallback_available: true,
            spot_healthy: true,
            fallback_pool: None,
            ticket,
            prompt_tokens: 10,
            max_tokens: Some(500),
            inflight_work: [0.0; 2],
        }
    }

    /// A recorded item decided by `rules` on `state`.
    pub(in super::super) fn recorded(
        state: &PolicyState,
        rules: &PolicyRules,
        tier: Tier,
        at: u64,
    ) -> Item {
        let f = facts(tier, at.wrapping_mul(2_654_435_761));
        let d = sluice_policy::decide(state, rules, &f);
        Item {
            request_id: format!("r{at}"),
            received_at_ms: at,
            replica: "a".into(),
            tenant: format!("t-{}", tier.as_str()),
            tier,
            inputs: PolicyInputs::capture(state, rules, &f, &d, Clock::new()),
            served: None,
            sla_target_ms: rules.tier(tier).slo.e2e_ms,
        }
    }

    pub(in super::super) fn item(tier: Tier, at: u64) -> Item {
        let rules = PolicyRules::default();
        recorded(&PolicyState::initial(), &rules, tier, at)
    }

    fn thresholds() -> PolicyRules {
        let mut r = PolicyRules {
            mode: PolicyMode::Thresholds,
            ..PolicyRules::default()
        };
        r.stability.consecutive_samples = 1;
        r.stability.cooldown_ms = 0;
        r.stability.hysteresis = 0.0;
        r
    }

    /// A thresholds-mode recording: pressure climbs 20 → 95 and back over 40 samples, one
    /// request per tier per sample; served ones took `latency(tier, sample)`.
    fn thresholds_run(rules: &PolicyRules) -> Vec<Item> {
        let mut engine = PolicyEngine::new(rules.clone());
        let mut items = Vec::new();
        for i in 0..40u64 {
            let p = if i < 20 {
                20.0 + i as f64 * 4.0
            } else {
                95.0 - (i - 20) as f64 * 4.0
            };
            let sig = PoolSignals {
                pressure: Some(p),
                queue_depth: Some(0.0),
                ..Default::default()
            };
            let s = engine.observe(&sig, &PoolSignals::default(), i * 1000);
            for tier in Tier::ALL {
                let mut it = recorded(&s, rules, tier, i * 1000 + tier.index() as u64);
                if it.inputs.decided.action.serves() {
                    let latency_ms = 100.0 + p * 10.0;
                    it.served = Some(Served {
                        latency_ms,
                        violated: latency_ms as u64
                            > rules.tier(tier).slo.e2e_ms.unwrap_or(u64::MAX),
                    });
                }
                items.push(it);
            }
        }
        items
    }

    #[test]
    fn the_same_rules_replay_every_decision_identically() {
        let rules = thresholds();
        let items = thresholds_run(&rules);
        let distinct: std::collections::BTreeSet<_> =
            items.iter().map(|i| i.inputs.decided.action).collect();
        assert!(distinct.len() >= 3, "{distinct:?}");
        let r = replay(&items, &rules);
        assert!(r.outcomes.iter().all(|o| o.recorded == o.replayed));
        assert_eq!(r.notes.tier_state_rebuilt, 0);
        let s = summarise(&items, &r.outcomes);
        assert_eq!((s.total.changed, s.total.reason_only), (0, 0));
        assert_eq!(s.total.sla.recorded, s.total.sla.estimated);
    }

    /// Adaptive mode: a controller that has risen, so levels, shares by ticket and the
    /// fallback's saturation all take part.
    #[test]
    fn adaptive_decisions_replay_identically_and_follow_the_candidate_ladder() {
        let rules = PolicyRules::default();
        let mut engine = PolicyEngine::new(rules.clone());
        let mut items = Vec::new();
        // Two samples 3 s apart: the level climbs to about 1.35, then 2.7 (Standard capped,
        // capped deeper, then partly moved to the fallback by ticket).
        for t in 1..=2u64 {
            let mut od: Vec<Heard> = Vec::new();
            for (tier, ms) in [(Tier::Guaranteed, 2300.0), (Tier::Standard, 500.0)] {
                od.extend((0..10).map(|_| Heard::served(t * 3000, tier, ms)));
            }
            let sig = PoolSignals::default();
            let s = engine.sample(&sig, &sig, [&od, &[]], t * 3000);
            for n in 0..50 {
                for tier in Tier::ALL {
                    items.push(recorded(
                        &s,
                        &rules,
                        tier,
                        t * 100_000 + n * 3 + tier.index() as u64,
                    ));
                }
            }
        }
        let kinds: std::collections::BTreeSet<_> =
            items.iter().map(|i| i.inputs.decided.action).collect();
        assert!(kinds.len() >= 3, "{kinds:?}");
        let r = replay(&items, &rules);
        let changed = r
            .outcomes
            .iter()
            .filter(|o| o.recorded != o.replayed)
            .count();
        assert_eq!(changed, 0);
        assert_eq!(r.notes.level_under_other_knobs, 0);

        // No caps for Standard: its cap and brownout steps leave the ladder, so the same level
        // reaches two steps further, and nothing is capped.
        let mut nocap = rules.clone();
        nocap.tiers[Tier::Standard.index()].max_tokens_cap = None;
        nocap.tiers[Tier::Standard.index()].brownout_max_tokens = None;
        let r = replay(&items, &nocap);
        let s = summarise(&items, &r.outcomes);
        assert_eq!(s.tiers["Standard"].candidate.degrade, 0);
        assert!(s.tiers["Standard"].changed > 0);
        assert_eq!(r.notes.level_under_other_knobs, items.len() as u64);
        assert_eq!(s.tiers["Guaranteed"].changed, 0);

        // No fallback configured: nothing can be moved, whatever availability was recorded.
        assert!(
            summarise(&items, &replay(&items, &rules).outcomes).tiers["Standard"]
                .recorded
                .fallback
                > 0
        );
        let mut nofallback = rules.clone();
        nofallback.fallback_capacity = FallbackCapacity::None;
        let r = replay(&items, &nofallback);
        let s = summarise(&items, &r.outcomes);
        assert_eq!(s.total.candidate.fallback, 0);
        assert_eq!(
            s.tiers["Standard"].changed,
            s.tiers["Standard"].recorded.fallback
        );
    }

    #[test]
    fn a_stricter_threshold_rebuilds_only_that_tier_and_counts_the_changes() {
        let rules = thresholds();
        let items = thresholds_run(&rules);
        let mut strict = rules.clone();
        strict.tiers[Tier::BestEffort.index()]
            .thresholds
            .pressure
            .critical_at = Some(44.0);
        let r = replay(&items, &strict);
        let be = items.iter().filter(|i| i.tier == Tier::BestEffort).count() as u64;
        assert_eq!(r.notes.tier_state_rebuilt, be);
        assert_eq!(r.notes.fallback_rebuilt, 0);
        // By hand: Best-Effort is refused from 44 (new) instead of 60 (recorded).
        let expected: Vec<&str> = items
            .iter()
            .filter(|i| i.tier == Tier::BestEffort)
            .filter(|i| (44.0..60.0).contains(&i.inputs.pools[0].pressure.unwrap()))
            .map(|i| i.request_id.as_str())
            .collect();
        let changed: Vec<&str> = items
            .iter()
            .zip(&r.outcomes)
            .filter(|(_, o)| o.changed())
            .map(|(i, _)| i.request_id.as_str())
            .collect();
        assert_eq!(changed, expected);
        let s = summarise(&items, &r.outcomes);
        let t = &s.tiers["Best-Effort"];
        assert_eq!(t.transitions["pass->reject"], expected.len() as u64);
        assert_eq!(t.deltas(), (expected.len() as i64, 0, 0));
        // Latency 100 + 10 p is over Best-Effort's 500 ms above p = 40: all of them were late.
        assert_eq!(t.sla.late_to_refused, expected.len() as u64);
        assert_eq!(
            t.sla.estimated.refused,
            t.sla.recorded.refused + expected.len() as u64
        );
        assert_eq!(
            s.tiers["Standard"].changed + s.tiers["Guaranteed"].changed,
            0
        );
    }

    #[test]
    fn refusals_that_would_be_served_borrow_a_latency() {
        let rules = thresholds();
        let items = thresholds_run(&rules);
        let mut loose = rules.clone();
        loose.tiers[Tier::BestEffort.index()]
            .thresholds
            .pressure
            .critical_at = Some(90.0);
        let r = replay(&items, &loose);
        let s = summarise(&items, &r.outcomes);
        let t = &s.tiers["Best-Effort"];
        assert!(t.transitions["reject->pass"] > 0);
        // Served Best-Effort requests were all recorded below 60, so the nearest ones are
        // late (100 + 10 × ≥ 40 > 500) except those under 40.
        assert_eq!(
            t.sla.refused_to_on_time + t.sla.refused_to_late + t.sla.refused_to_unknown,
            t.transitions["reject->pass"]
        );
        assert!(r
            .outcomes
            .iter()
            .filter(|o| o.changed())
            .all(|o| o.estimated_ms.is_some()));
    }

    #[test]
    fn a_mode_switch_rebuilds_tier_states_from_the_signals() {
        // Recorded adaptive; the candidate is the prototype's thresholds.
        let rules = PolicyRules::default();
        let mut engine = PolicyEngine::new(rules.clone());
        let mut items = Vec::new();
        for i in 0..5u64 {
            let sig = PoolSignals {
                pressure: Some(65.0),
                ..Default::default()
            };
            let s = engine.observe(&sig, &PoolSignals::default(), i * 1000);
            items.push(recorded(&s, &rules, Tier::BestEffort, i));
        }
        assert!(items
            .iter()
            .all(|i| i.inputs.decided.action == ActionKind::Pass));
        let r = replay(&items, &thresholds());
        assert!(r
            .outcomes
            .iter()
            .all(|o| o.replayed.action == ActionKind::Reject));
        assert_eq!(r.notes.recorded_modes["adaptive"], 5);
    }
}
