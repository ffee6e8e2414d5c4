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
use sluice_policy::slo::{judge, Dim, Judged, Measured, Slo};
use sluice_policy::tenant_policy::{FallbackCapacity, PolicyRules};
use sluice_policy::{PolicyMode, PolicyState, Pool, Tier};
use sluice_record::inputs::{fingerprint, ActionKind, Decided, PolicyInputs};
use std::collections::BTreeMap;

/// What happened to a request, as recorded or as estimated under the candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Served within every target of its tier's objective (or served with none to judge it on).
    OnTime,
    /// Served, and missed at least one dimension of its objective.
    Late,
    /// Refused by the policy.
    Refused,
    /// Admitted by the policy, then not served (capacity, queue, backend error, client gone).
    NotServed,
    /// Served, but no estimate is possible for a dimension of its objective.
    Unknown,
}

/// How a served request fared on one dimension of its objective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mark {
    /// The objective sets no target for it, or it does not apply (a one-token stream's pace, a
    /// whole answer's TTFT without a TPOT target to set its deadline).
    #[default]
    NotJudged,
    Met,
    Missed,
    /// An estimate with nothing recorded to borrow this dimension from.
    Unknown,
}

/// Per dimension, in [`Dim::index`] order.
pub type Marks = [Mark; 3];

/// How `m` fares on each dimension of `slo` ([`judge`]'s verdict, with the dimensions it could
/// not judge told apart): `estimated` when `m` was borrowed, so a dimension missing from it is
/// unknown rather than not applying.
pub fn marks(slo: &Slo, m: &Measured, estimated: bool) -> Marks {
    let j = judge(slo, m);
    let mut out = [Mark::NotJudged; 3];
    for d in slo.dims() {
        // None: the rule judges no such dimension of this answer; Some(false): it would, but
        // there is no measurement of it.
        let measurable = match d {
            Dim::E2e => Some(m.latency_ms.is_finite()),
            // A whole answer meets TTFT and TPOT by the stream's deadline, for its tokens.
            _ if !m.stream => slo
                .whole_deadline_ms(1)
                .map(|_| !estimated || m.completion_tokens.is_some()),
            Dim::Ttft => Some(m.ttft_ms.is_some()),
            Dim::Tpot => Some(m.tpot_ms.is_some()),
        };
        out[d.index()] = match measurable {
            None => Mark::NotJudged,
            Some(false) if estimated => Mark::Unknown,
            Some(false) => Mark::NotJudged,
            Some(true) if j.missed[d.index()] => Mark::Missed,
            Some(true) => Mark::Met,
        };
    }
    out
}

/// The fate of a served request from its marks.
fn fate_of_marks(m: &Marks) -> Fate {
    if m.contains(&Mark::Unknown) {
        Fate::Unknown
    } else if m.contains(&Mark::Missed) {
        Fate::Late
    } else {
        Fate::OnTime
    }
}

/// The missed dimensions as the ledger writes them (`"ttft,tpot"`), `None` when none was.
pub fn missed_label(m: &Marks) -> Option<&'static str> {
    Judged {
        missed: m.map(|m| m == Mark::Missed),
        judged: true,
    }
    .missed_label()
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
    /// Per dimension, as recorded (on the objective it was judged on) and under the candidate.
    pub recorded_marks: Marks,
    pub replayed_marks: Marks,
    /// The objective the candidate judges it on.
    pub objective: Slo,
    /// The borrowed end-to-end latency when the candidate serves the request differently.
    pub estimated_ms: Option<f64>,
    /// Everything borrowed then (TTFT and TPOT for a stream, completion tokens).
    pub estimated: Option<Measured>,
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
    // The controller's fingerprint covers every tier's objective: while it is the recorded one,
    // each request's objective is the one it was judged on, tightened by its own headers
    // included.
    let same_objectives = |it: &Item| fps[it.tier.index()].controller == it.inputs.rules.controller;
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
            let objective = if same_objectives(it) {
                it.recorded_slo()
            } else {
                rules.tier(it.tier).slo
            };
            fate(it, rec.decided, replayed, objective, &estimator)
        })
        .collect();
    Replay { outcomes, notes }
}

/// The recorded and the estimated fate of one request, on `objective` (see
/// [`super::estimate`]).
fn fate(
    it: &Item,
    recorded: Decided,
    replayed: Decided,
    objective: Slo,
    estimator: &Estimator,
) -> Outcome {
    let recorded_fate = fate_of(it.served, recorded.action == ActionKind::Reject);
    let recorded_marks = it.served.map_or([Mark::NotJudged; 3], |s| {
        // Which dimensions applied, with the verdicts the proxy recorded (its own measurements,
        // unrounded).
        let mut m = marks(&it.recorded_slo(), &s.measured, false);
        for d in Dim::ALL {
            let i = d.index();
            if s.missed[i] {
                m[i] = Mark::Missed;
            } else if m[i] == Mark::Missed {
                m[i] = Mark::Met;
            }
        }
        m
    });
    let unknown = {
        let mut m = [Mark::NotJudged; 3];
        for d in objective.dims() {
            m[d.index()] = Mark::Unknown;
        }
        m
    };
    let mut estimated = None;
    let (replayed_fate, replayed_marks) = if !replayed.action.serves() {
        (Fate::Refused, [Mark::NotJudged; 3])
    } else if recorded.same_effect(&replayed) {
        match it.served {
            // Judged on the same objective: the recorded verdict stands.
            Some(_) if objective == it.recorded_slo() => (recorded_fate, recorded_marks),
            Some(s) => {
                let m = marks(&objective, &s.measured, false);
                (fate_of_marks(&m), m)
            }
            None => (recorded_fate, [Mark::NotJudged; 3]),
        }
    } else if recorded_fate == Fate::NotServed {
        // Capacity and backends are not replayed: what kept it from being served still would.
        (Fate::NotServed, [Mark::NotJudged; 3])
    } else {
        let stream = it.served.map(|s| s.measured.stream);
        estimated = estimator.measured(
            it.tier,
            replayed.pool,
            replayed.action,
            it.received_at_ms,
            stream,
        );
        match &estimated {
            Some(m) => {
                let m = marks(&objective, m, true);
                (fate_of_marks(&m), m)
            }
            None => (Fate::Unknown, unknown),
        }
    };
    Outcome {
        recorded,
        replayed,
        recorded_fate,
        replayed_fate,
        recorded_marks,
        replayed_marks,
        objective,
        estimated_ms: estimated.map(|m| m.latency_ms),
        estimated,
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

/// Answers judged on one dimension (or on their whole objective), and how many were on time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub judged: u64,
    pub on_time: u64,
    /// Served under the candidate, but with nothing recorded to estimate this from.
    pub unknown: u64,
}

impl Tally {
    /// The share on time, `None` when nothing was judged.
    pub fn share(&self) -> Option<f64> {
        (self.judged > 0).then(|| self.on_time as f64 / self.judged as f64)
    }

    fn add(&mut self, on_time: Option<bool>) {
        match on_time {
            Some(on_time) => {
                self.judged += 1;
                self.on_time += u64::from(on_time);
            }
            None => self.unknown += 1,
        }
    }
}

impl Serialize for Tally {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut t = s.serialize_struct("Tally", 4)?;
        t.serialize_field("judged", &self.judged)?;
        t.serialize_field("on_time", &self.on_time)?;
        t.serialize_field("unknown", &self.unknown)?;
        t.serialize_field("share", &self.share())?;
        t.end()
    }
}

/// Attainment of a group's answers: per dimension of the objective and overall.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Attainment {
    pub ttft: Tally,
    pub tpot: Tally,
    pub e2e: Tally,
    /// Every dimension judged met (served answers; an objective judging none of an answer
    /// counts it on time).
    pub overall: Tally,
}

impl Attainment {
    pub fn dim(&self, d: Dim) -> &Tally {
        match d {
            Dim::Ttft => &self.ttft,
            Dim::Tpot => &self.tpot,
            Dim::E2e => &self.e2e,
        }
    }

    fn dim_mut(&mut self, d: Dim) -> &mut Tally {
        match d {
            Dim::Ttft => &mut self.ttft,
            Dim::Tpot => &mut self.tpot,
            Dim::E2e => &mut self.e2e,
        }
    }

    fn add(&mut self, fate: Fate, marks: &Marks) {
        for d in Dim::ALL {
            match marks[d.index()] {
                Mark::NotJudged => {}
                Mark::Met => self.dim_mut(d).add(Some(true)),
                Mark::Missed => self.dim_mut(d).add(Some(false)),
                Mark::Unknown => self.dim_mut(d).add(None),
            }
        }
        match fate {
            Fate::OnTime => self.overall.add(Some(true)),
            Fate::Late => self.overall.add(Some(false)),
            Fate::Unknown => self.overall.add(None),
            Fate::Refused | Fate::NotServed => {}
        }
    }
}

/// Attainment as recorded and as estimated under the candidate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Attainments {
    /// The dimensions the candidate's objective sets for some of these requests
    /// (`ttft`, `tpot`, `e2e`).
    pub in_force: Vec<&'static str>,
    pub recorded: Attainment,
    pub estimated: Attainment,
}

impl Attainments {
    fn add(&mut self, o: &Outcome) {
        self.recorded.add(o.recorded_fate, &o.recorded_marks);
        self.estimated.add(o.replayed_fate, &o.replayed_marks);
        if o.objective
            .dims()
            .any(|d| !self.in_force.contains(&d.as_str()))
        {
            let slo = o.objective;
            let was = std::mem::take(&mut self.in_force);
            self.in_force = Dim::ALL
                .into_iter()
                .map(Dim::as_str)
                .filter(|d| was.contains(d) || slo.dims().any(|s| s.as_str() == *d))
                .collect();
        }
    }

    /// Whether the candidate's objective sets `d` for some of these requests.
    pub fn in_force(&self, d: Dim) -> bool {
        self.in_force.contains(&d.as_str())
    }
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
    /// Share on time per dimension of the objective and overall, recorded -> estimated.
    pub attainment: Attainments,
}

impl Summary {
    pub fn add(&mut self, o: &Outcome) {
        self.decisions += 1;
        self.recorded.add(o.recorded.action);
        self.candidate.add(o.replayed.action);
        self.sla.recorded.add(o.recorded_fate);
        self.sla.estimated.add(o.replayed_fate);
        self.attainment.add(o);
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
            ttft_target_ms: rules.tier(tier).slo.ttft_ms,
            tpot_target_ms: rules.tier(tier).slo.tpot_ms,
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
                    it.served = Some(Served::e2e(
                        latency_ms,
                        latency_ms as u64 > rules.tier(tier).slo.e2e_ms.unwrap_or(u64::MAX),
                    ));
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

    /// Standard's objective as TTFT and TPOT targets.
    fn ttft_tpot(ttft_ms: u64, tpot_ms: u64) -> PolicyRules {
        let mut r = thresholds();
        r.tiers[Tier::Standard.index()].slo = Slo {
            ttft_ms: Some(ttft_ms),
            tpot_ms: Some(tpot_ms),
            e2e_ms: None,
        };
        r
    }

    /// A Standard request recorded under `rules` at low pressure (passed), served as measured
    /// and judged as the proxy judges, on `targets` (its tier's, or tighter ones it asked for).
    fn served_item(rules: &PolicyRules, at: u64, m: Measured, targets: Slo) -> Item {
        let sig = PoolSignals {
            pressure: Some(10.0),
            queue_depth: Some(0.0),
            ..Default::default()
        };
        let s = PolicyEngine::new(rules.clone()).observe(&sig, &PoolSignals::default(), 0);
        let mut it = recorded(&s, rules, Tier::Standard, at);
        assert_eq!(it.inputs.decided.action, ActionKind::Pass);
        it.ttft_target_ms = targets.ttft_ms;
        it.tpot_target_ms = targets.tpot_ms;
        let j = judge(&targets, &m);
        it.served = Some(Served {
            measured: m,
            violated: !j.met(),
            missed: j.missed,
        });
        it
    }

    fn stream(ttft: f64, tpot: f64, tokens: u64) -> Measured {
        Measured::stream(ttft, tpot, tokens)
    }

    #[test]
    fn a_recorded_stream_rejudged_under_a_tighter_ttft_target_becomes_late() {
        let rules = ttft_tpot(500, 50);
        let tier = rules.tier(Tier::Standard).slo;
        // A stream with its first token at 400 ms and 20 ms a token; a whole answer of 100
        // tokens in 2 s (its deadline 500 + 50 × 99 = 5450 ms); a stream that asked for its
        // first token within 200 ms and got it at 250.
        let items = vec![
            served_item(&rules, 1, stream(400.0, 20.0, 100), tier),
            served_item(
                &rules,
                2,
                Measured {
                    latency_ms: 2000.0,
                    completion_tokens: Some(100),
                    ..Measured::default()
                },
                tier,
            ),
            served_item(
                &rules,
                3,
                stream(250.0, 20.0, 100),
                tier.tightened(Some(200), None),
            ),
        ];
        // The config in force: every recorded verdict stands, the asked-for target included.
        let r = replay(&items, &rules);
        let fates: Vec<_> = r.outcomes.iter().map(|o| o.replayed_fate).collect();
        assert_eq!(fates, [Fate::OnTime, Fate::OnTime, Fate::Late]);
        assert!(r
            .outcomes
            .iter()
            .all(|o| (o.recorded_fate, o.recorded_marks) == (o.replayed_fate, o.replayed_marks)));
        use Mark::*;
        assert_eq!(r.outcomes[0].recorded_marks, [Met, Met, NotJudged]);
        assert_eq!(r.outcomes[2].recorded_marks, [Missed, Met, NotJudged]);

        // TTFT tightened to 300 ms: the same decisions, and the first stream is now late on
        // its first token alone; the whole answer still meets 300 + 50 × 99.
        let tight = ttft_tpot(300, 50);
        let r = replay(&items, &tight);
        assert!(r.outcomes.iter().all(|o| !o.changed()));
        let first = &r.outcomes[0];
        assert_eq!(first.recorded_fate, Fate::OnTime);
        assert_eq!(first.replayed_fate, Fate::Late);
        assert_eq!(first.replayed_marks, [Missed, Met, NotJudged]);
        assert_eq!(missed_label(&first.replayed_marks), Some("ttft"));
        assert_eq!(r.outcomes[1].replayed_fate, Fate::OnTime);
        assert_eq!(r.outcomes[1].replayed_marks, [Met, Met, NotJudged]);
        // Under objectives other than the recorded ones, the asked-for 200 ms is not known
        // apart from the tier's: judged on the tier's 300, 250 ms is on time.
        assert_eq!(r.outcomes[2].replayed_fate, Fate::OnTime);

        let s = summarise(&items, &r.outcomes);
        let a = &s.tiers["Standard"].attainment;
        assert_eq!(a.in_force, ["ttft", "tpot"]);
        assert_eq!((a.recorded.ttft.judged, a.recorded.ttft.on_time), (3, 2));
        assert_eq!((a.estimated.ttft.judged, a.estimated.ttft.on_time), (3, 2));
        assert_eq!((a.recorded.tpot.judged, a.recorded.tpot.on_time), (3, 3));
        assert_eq!(a.estimated.e2e, Tally::default());
        assert_eq!(a.recorded.overall.share(), Some(2.0 / 3.0));
        assert_eq!(
            (s.total.sla.recorded.late, s.total.sla.estimated.late),
            (1, 1)
        );
        // Tighter still, TPOT too: the whole answer misses the deadline (200 + 15 × 99 =
        // 1685 ms) on both, a whole answer's only verdict.
        let r = replay(&items, &ttft_tpot(200, 15));
        assert_eq!(r.outcomes[1].replayed_marks, [Missed, Missed, NotJudged]);
        assert_eq!(r.outcomes[0].replayed_marks, [Missed, Missed, NotJudged]);
    }

    /// The replay before objectives had dimensions: a served request judged on its end-to-end
    /// latency against `rules.tier(t).slo.e2e_ms` in whole milliseconds, a changed one on the
    /// median latency borrowed.
    fn todays_fate(it: &Item, o: &Outcome, rules: &PolicyRules, e: &Estimator) -> Fate {
        let recorded_fate = fate_of(it.served, o.recorded.action == ActionKind::Reject);
        let target = rules.tier(it.tier).slo.e2e_ms.unwrap_or(u64::MAX);
        let verdict = |ms: f64| {
            if (ms.max(0.0).floor() as u64) > target {
                Fate::Late
            } else {
                Fate::OnTime
            }
        };
        if !o.replayed.action.serves() {
            Fate::Refused
        } else if o.recorded.same_effect(&o.replayed) {
            match it.served {
                Some(s) if it.sla_target_ms == Some(target) && target != u64::MAX => {
                    fate_of(Some(s), false)
                }
                Some(s) => verdict(s.measured.latency_ms),
                None => recorded_fate,
            }
        } else if recorded_fate == Fate::NotServed {
            Fate::NotServed
        } else {
            let (pool, action) = (o.replayed.pool, o.replayed.action);
            e.estimate(it.tier, pool, action, it.received_at_ms)
                .map_or(Fate::Unknown, verdict)
        }
    }

    #[test]
    fn a_candidate_with_only_e2e_gives_exactly_todays_verdicts() {
        let rules = thresholds();
        let items = thresholds_run(&rules);
        let estimator = Estimator::new(&items);
        let mut candidates = vec![rules.clone()];
        // Other end-to-end targets (latencies run 300 to 1050 ms).
        let mut targets = rules.clone();
        targets.tiers[Tier::Guaranteed.index()].slo = Slo::e2e(800);
        targets.tiers[Tier::Standard.index()].slo = Slo::e2e(620);
        targets.tiers[Tier::BestEffort.index()].slo = Slo::e2e(900);
        candidates.push(targets.clone());
        // Refusals that would be served (their latency borrowed, late against 480 ms), and a
        // tier left without any target; then answers now refused.
        let mut loose = targets.clone();
        loose.tiers[Tier::BestEffort.index()]
            .thresholds
            .pressure
            .critical_at = Some(90.0);
        loose.tiers[Tier::BestEffort.index()].slo = Slo::e2e(480);
        loose.tiers[Tier::Guaranteed.index()].slo = Slo::default();
        candidates.push(loose);
        let mut strict = targets.clone();
        strict.tiers[Tier::BestEffort.index()]
            .thresholds
            .pressure
            .critical_at = Some(44.0);
        candidates.push(strict);
        // The borrowed latency is 495 ms: exactly at the target is on time.
        let mut at_target = candidates[2].clone();
        at_target.tiers[Tier::BestEffort.index()].slo = Slo::e2e(495);
        candidates.push(at_target);
        let mut seen = std::collections::BTreeSet::new();
        for (n, c) in candidates.iter().enumerate() {
            let r = replay(&items, c);
            for (it, o) in items.iter().zip(&r.outcomes) {
                let recorded = fate_of(it.served, o.recorded.action == ActionKind::Reject);
                assert_eq!(o.recorded_fate, recorded, "candidate {n}: {it:?}");
                assert_eq!(
                    o.replayed_fate,
                    todays_fate(it, o, c, &estimator),
                    "candidate {n}: {it:?} {o:?}"
                );
                if o.changed() && o.replayed.action.serves() {
                    let (pool, action) = (o.replayed.pool, o.replayed.action);
                    let e = estimator.estimate(it.tier, pool, action, it.received_at_ms);
                    assert_eq!(o.estimated_ms, e);
                }
                // Only the end-to-end dimension is ever judged.
                assert_eq!(o.replayed_marks[Dim::Ttft.index()], Mark::NotJudged);
                assert_eq!(o.replayed_marks[Dim::Tpot.index()], Mark::NotJudged);
                seen.insert((n, o.changed(), o.replayed_fate.as_str()));
            }
            let s = summarise(&items, &r.outcomes);
            let a = &s.total.attainment.estimated;
            assert_eq!(
                a.e2e.on_time,
                s.total.sla.estimated.on_time - {
                    // Guaranteed without a target: served, on time, judged on nothing.
                    let g = &s.tiers["Guaranteed"];
                    if c.tier(Tier::Guaranteed).slo.is_empty() {
                        g.sla.estimated.on_time
                    } else {
                        0
                    }
                }
            );
            assert_eq!(a.e2e.judged - a.e2e.on_time, s.total.sla.estimated.late);
            assert_eq!(a.overall.on_time, s.total.sla.estimated.on_time);
        }
        // The check covers kept, re-judged, refused and estimated verdicts, late and on time.
        for want in [
            (1, false, "late"),
            (1, false, "on time"),
            (3, true, "refused"),
            (2, true, "late"),
            (4, true, "on time"),
        ] {
            assert!(seen.contains(&want), "{want:?} not among {seen:?}");
        }
    }

    #[test]
    fn a_changed_decision_borrows_ttft_and_tpot_from_the_streams_like_it() {
        // Every served answer streamed: first token at a quarter of its latency, the rest
        // over 50 tokens.
        let mut rules = thresholds();
        rules.tiers[Tier::BestEffort.index()].slo = Slo {
            ttft_ms: Some(250),
            tpot_ms: Some(12),
            e2e_ms: None,
        };
        let mut items = thresholds_run(&rules);
        for it in &mut items {
            let slo = it.recorded_slo();
            if let Some(s) = it.served.as_mut() {
                let l = s.measured.latency_ms;
                s.measured = stream(l / 4.0, l * 0.75 / 49.0, 50);
                let j = judge(&slo, &s.measured);
                (s.violated, s.missed) = (!j.met(), j.missed);
            }
        }
        let mut loose = rules.clone();
        loose.tiers[Tier::BestEffort.index()]
            .thresholds
            .pressure
            .critical_at = Some(90.0);
        let r = replay(&items, &loose);
        let e = Estimator::new(&items);
        let mut borrowed = 0;
        for (it, o) in items.iter().zip(&r.outcomes) {
            if !(o.changed() && o.recorded_fate == Fate::Refused) {
                continue;
            }
            borrowed += 1;
            // Refused before, its form unknown: its neighbours all streamed, so it streams,
            // judged on their TTFT and TPOT.
            let (pool, action) = (o.replayed.pool, o.replayed.action);
            let m = e
                .measured(it.tier, pool, action, it.received_at_ms, None)
                .unwrap();
            assert!(m.stream && m.ttft_ms.is_some() && m.tpot_ms.is_some());
            assert_eq!(o.estimated, Some(m));
            let j = judge(&o.objective, &m);
            assert_eq!(
                o.replayed_fate,
                if j.met() { Fate::OnTime } else { Fate::Late }
            );
            assert_eq!(o.replayed_marks[Dim::E2e.index()], Mark::NotJudged);
            assert!(o.replayed_marks[..2].iter().all(|m| *m != Mark::NotJudged));
        }
        assert!(borrowed > 0);
        let s = summarise(&items, &r.outcomes);
        let be = &s.tiers["Best-Effort"].attainment;
        assert_eq!(be.in_force, ["ttft", "tpot"]);
        assert!(be.estimated.ttft.judged > be.recorded.ttft.judged);
    }
}
