//! Adaptive mode, per request: route first, so a tier is judged on the pool that serves it, then
//! place the request within its tier's shares at that pool's admission level
//! ([`super::adaptive`]). Routing stays a QoS choice: Best-Effort leaves spot only when spot is
//! unhealthy or past its own eviction rail, and is then judged by on-demand's controller.

use crate::adaptive::{draw, PoolControl, RailKind, Shares};
use crate::reason::Reason;
use crate::slo::Dim;
use crate::state::{Decision, PolicyState};
use crate::tenant_policy::PolicyRules;
use crate::types::{Action, Pool, PressureState, RequestFacts, Tier, TierState};
use crate::work_gate;

/// The state a tier shows in `/status`, gauges and decisions: Critical while part of it is
/// shed, Elevated while part of it is capped or moved.
fn shown_state(s: Shares) -> PressureState {
    if s.shed > 0.0 {
        PressureState::Critical
    } else if s.cap > 0.0 || s.fallback > 0.0 || s.brownout > 0.0 {
        PressureState::Elevated
    } else {
        PressureState::Normal
    }
}

/// Each tier's state on its preferred pool.
pub(super) fn tier_states(
    rules: &PolicyRules,
    pools: &[PoolControl; 2],
    tiers: &mut [TierState; 3],
) {
    for t in tiers.iter_mut() {
        let pool = rules
            .tier(t.tier)
            .preferred_pool
            .signal_index()
            .unwrap_or(0);
        t.state = shown_state(pools[pool].shares(t.tier));
        t.fail_open = false;
    }
}

pub(super) fn decide(state: &PolicyState, rules: &PolicyRules, req: &RequestFacts) -> Decision {
    let tier = rules.tier(req.tier);
    let (pool, route_reason) = match tier.preferred_pool {
        Pool::Spot if !req.spot_healthy => (Pool::OnDemand, Reason::RouteSpotUnhealthy),
        Pool::Spot if state.spot_state == PressureState::Critical => {
            (Pool::OnDemand, Reason::RouteSpotPressure)
        }
        p => (p, Reason::RouteTierPool),
    };
    let (pool, route_reason) = if overflows_to_spot(state, rules, req, pool) {
        (Pool::Spot, Reason::RouteGuaranteedOverflow)
    } else {
        (pool, route_reason)
    };
    let ctl = &state.pools[pool.signal_index().unwrap_or(0)];
    let shares = ctl.shares(req.tier);
    let decision = |action, reason, pool, route_reason| Decision {
        tier: req.tier,
        state: shown_state(shares),
        action,
        reason,
        pool,
        route_reason,
        queue_eligible: tier.queue_eligible,
    };
    if !req.shapeable {
        return decision(
            Action::Pass,
            Reason::EndpointNotShapeable,
            pool,
            route_reason,
        );
    }
    let u = draw(req.ticket);
    // The fallback is other capacity only while the pool it runs on is not short itself, and
    // has room to lend for this answer.
    let fallback_usable = req.fallback_available
        && req
            .fallback_pool
            .and_then(Pool::signal_index)
            .is_none_or(|i| !state.pools[i].saturated && lends(state, rules, req, i));
    // Past the fallback step, a request may still be moved where its tier may fall back and the
    // fallback is other capacity than this pool.
    let may_move = fallback_usable && tier.fallback_eligible && rules.fallback_relieves(pool);
    let to_fallback = |reason, cap| {
        let action = Action::Fallback { max_tokens: cap };
        decision(action, reason, Pool::Fallback, Reason::RouteFallback)
    };
    if u < shares.shed {
        // A shed request would also have been moved (the steps nest): while the fallback can
        // still take it, its answer there meets an objective a 429 never does. A rail refuses,
        // as the operator's hard limit.
        if ctl.rail.is_none() && may_move {
            return to_fallback(
                Reason::FallbackHeadroom,
                tier.brownout_max_tokens.or(tier.max_tokens_cap),
            );
        }
        let reason = match ctl.rail {
            Some(RailKind::Pressure) => Reason::RailPressure,
            Some(RailKind::QueueDepth) => Reason::RailQueueDepth,
            None => Reason::ShedHeadroom,
        };
        return decision(Action::Reject, reason, pool, route_reason);
    }
    let brownout = tier.brownout_max_tokens.filter(|_| u < shares.brownout);
    let cap = brownout.or(tier.max_tokens_cap.filter(|_| u < shares.cap));
    if u < shares.fallback && fallback_usable {
        return to_fallback(Reason::FallbackHeadroom, cap);
    }
    // A filling cache is held for whole answers by what it admits now, so while the fallback
    // is other capacity with room, what may go there goes, and the pool keeps room for the
    // tiers above (measured: Guaranteed's first tokens wait less behind a full cache).
    let filling = |i: Option<usize>| i.and_then(|i| state.pools.get(i)).and_then(|c| c.filling);
    let fallback_pool = req.fallback_pool.and_then(Pool::signal_index);
    if may_move
        && filling(pool.signal_index()) == Some(true)
        && filling(fallback_pool) == Some(false)
    {
        return to_fallback(Reason::FallbackCacheFilling, cap);
    }
    // Guaranteed's pool lends room only while it is not busy, where Guaranteed's first-token
    // target is tight: its misses come in spikes its headroom gives no warning of, and what a
    // lower tier starts there holds the pool for its whole answer. Unknown KV usage fails
    // open, as everywhere.
    let t = &rules.adaptive;
    if t.reserves_guaranteed_pool()
        && req.tier != Tier::Guaranteed
        && tier.fallback_eligible
        && pool == rules.tier(Tier::Guaranteed).preferred_pool
        && req.fallback_available
        && rules.fallback_relieves(pool)
        && ctl.filling.is_some()
        && ctl.busy
        && guaranteed_ttft_tight(ctl, t.reserve_ttft_below_x)
    {
        // Moved onto a batch already spending its tiers' pace, a long answer would cost them
        // what it saves Guaranteed (measured without this: Best-Effort on spot up to 2.6 points
        // lower at 1.3×).
        let calm = filling(fallback_pool) == Some(false)
            && fallback_pool
                .and_then(|i| state.pools.get(i))
                .is_some_and(|c| c.level == 0.0 && !c.pace_busy);
        if may_move && calm {
            return to_fallback(Reason::FallbackPoolReserved, cap);
        }
        return decision(
            Action::Reject,
            Reason::RejectPoolReserved,
            pool,
            route_reason,
        );
    }
    // The work gate: while the level is up, what it lets through must still fit the tier's
    // share of the pool's work limit (the predicted ceiling, and the learned limit where
    // `work_gate` is on). At level 0 nothing is gated: idle means open.
    let gate = work_gate::share(req.tier, t.work_share_standard, t.work_share_best_effort)
        .filter(|_| ctl.level > 0.0);
    let inflight = if rules.spot_is_on_demand {
        req.inflight_work.iter().sum()
    } else {
        req.inflight_work[pool.signal_index().unwrap_or(0)]
    };
    let work =
        |cap| work_gate::work_of(req.prompt_tokens, req.max_tokens, cap, t.assumed_max_tokens);
    let over = |cap| gate.is_some_and(|s| work_gate::over(inflight, work(cap), ctl.work_limit, s));
    if over(cap) {
        if let Some(max_tokens) = tier
            .max_tokens_cap
            .filter(|c| cap.is_none() && !over(Some(*c)))
        {
            let action = Action::Degrade { max_tokens };
            return decision(action, Reason::DegradeWorkLimit, pool, route_reason);
        }
        if may_move {
            return to_fallback(Reason::FallbackWorkLimit, cap);
        }
        return decision(Action::Reject, Reason::RejectWorkLimit, pool, route_reason);
    }
    match cap {
        Some(max_tokens) => decision(
            Action::Degrade { max_tokens },
            if ctl.shaping {
                Reason::DegradeCacheFull
            } else if brownout.is_some() {
                Reason::DegradeBrownout
            } else {
                Reason::DegradeHeadroom
            },
            pool,
            route_reason,
        ),
        None => decision(
            Action::Pass,
            Reason::AdmittedWithinHeadroom,
            pool,
            route_reason,
        ),
    }
}

/// `guaranteed_overflow_to_spot`: a Guaranteed request bound for a busy on-demand pool goes to
/// the spot pool serving its model while that one is healthy and calm (level 0, not busy), so
/// Guaranteed's arrivals are shared by two batches instead of growing one. Spot must be other
/// capacity (on a backend shared with on-demand nothing would be relieved) with room to lend
/// (its own tenants keep their pace). Only where Guaranteed has a TPOT objective: the batch's
/// pace is what it relieves, and with end-to-end targets alone the overflow cost Best-Effort
/// on spot 2.5–4 points against direct for nothing Guaranteed lacked (measured, `slowdown`).
fn overflows_to_spot(
    state: &PolicyState,
    rules: &PolicyRules,
    req: &RequestFacts,
    pool: Pool,
) -> bool {
    let [on_demand, spot] = &state.pools;
    rules.adaptive.guaranteed_overflow_to_spot
        && req.tier == Tier::Guaranteed
        && rules.tier(Tier::Guaranteed).slo.tpot_ms.is_some()
        && pool == Pool::OnDemand
        && req.spot_healthy
        && !rules.spot_is_on_demand
        && on_demand.busy
        && spot.level == 0.0
        && !spot.busy
        && lends(state, rules, req, Pool::Spot.signal_index().unwrap_or(1))
}

/// The pool at `index` has room for this request's work without passing its lend limit (a
/// limit not known yet lends: the pool's level and pace still guard it).
fn lends(state: &PolicyState, rules: &PolicyRules, req: &RequestFacts, index: usize) -> bool {
    let (Some(ctl), Some(inflight)) = (state.pools.get(index), req.inflight_work.get(index)) else {
        return true;
    };
    let work = work_gate::work_of(
        req.prompt_tokens,
        req.max_tokens,
        None,
        rules.adaptive.assumed_max_tokens,
    );
    !work_gate::over(*inflight, work, ctl.lend_limit, 1.0)
}

/// Guaranteed has a TTFT objective on this pool, and its target is under `below_x` times its
/// learned unloaded TTFT there (or that is not learned yet: the pool may be met busy).
fn guaranteed_ttft_tight(ctl: &PoolControl, below_x: Option<f64>) -> bool {
    let g = ctl.dims[Tier::Guaranteed.index()][Dim::Ttft.index()];
    match (g.target_ms, g.unloaded_ms, below_x) {
        (None, _, _) => false,
        (Some(target), Some(unloaded), Some(x)) => (target as f64) < x * unloaded,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::super::adaptive::Outcome;
    use super::super::{PolicyEngine, PoolSignals, Tier};
    use super::*;

    fn facts(tier: Tier, ticket: u64) -> RequestFacts {
        RequestFacts {
            fallback_pool: Some(Pool::Spot),
            ticket,
            ..RequestFacts::of(tier)
        }
    }

    fn served(at: u64, tier: Tier, latency_ms: f64, n: usize) -> Vec<Outcome> {
        (0..n)
            .map(|_| Outcome::served(at, tier, latency_ms))
            .collect()
    }

    /// The complaint: on-demand hot, spot idle. Best-Effort runs on spot and keeps
    /// being served; in thresholds mode the same state rejects it.
    #[test]
    fn best_effort_is_judged_on_spot_not_on_demand() {
        let rules = PolicyRules::default();
        let mut engine = PolicyEngine::new(rules.clone());
        let hot = PoolSignals {
            pressure: Some(75.0),
            ..Default::default()
        };
        let idle = PoolSignals {
            pressure: Some(10.0),
            ..Default::default()
        };
        let mut od = served(1000, Tier::Guaranteed, 600.0, 10);
        od.extend(served(1000, Tier::Standard, 500.0, 10));
        let sp = served(1000, Tier::BestEffort, 300.0, 10);
        let mut s = None;
        for t in 1..=6 {
            s = Some(engine.sample(&hot, &idle, [&od, &sp], t * 500));
        }
        let s = s.unwrap();
        for ticket in 0..50 {
            let d = decide(&s, &rules, &facts(Tier::BestEffort, ticket));
            assert_eq!(
                (d.action, d.reason, d.pool),
                (Action::Pass, Reason::AdmittedWithinHeadroom, Pool::Spot)
            );
        }
        let thresholds = PolicyRules {
            mode: super::super::PolicyMode::Thresholds,
            ..rules
        };
        let mut engine = PolicyEngine::new(thresholds.clone());
        engine.observe(&hot, &idle, 1000);
        let s = engine.observe(&hot, &idle, 2000);
        let d = super::super::decide(&s, &thresholds, &facts(Tier::BestEffort, 0));
        assert_eq!(d.action, Action::Reject);
    }

    /// Guaranteed close to its target on on-demand (5 % of headroom left), three samples 3 s
    /// apart: the level climbs past Standard's cap and brownout and into its fallback step
    /// (0.75 steps a sample at the shipped `rise_gain`). `spot_be_ms`: Best-Effort's latency on spot.
    fn guaranteed_short(spot_be_ms: Option<f64>) -> PolicyState {
        let mut engine = PolicyEngine::new(PolicyRules::default());
        let sig = PoolSignals::default();
        let mut s = None;
        for t in 1..=3u64 {
            let mut od = served(t * 3000, Tier::Guaranteed, 1900.0, 10);
            od.extend(served(t * 3000, Tier::Standard, 500.0, 10));
            let sp = spot_be_ms.map_or(Vec::new(), |ms| served(t * 3000, Tier::BestEffort, ms, 10));
            s = Some(engine.sample(&sig, &sig, [&od, &sp], t * 3000));
        }
        s.unwrap()
    }

    #[test]
    fn shares_pick_requests_by_ticket_and_nest() {
        let rules = PolicyRules::default();
        // Spot is idle, so the fallback is usable.
        let s = guaranteed_short(None);
        let shares = s.pools[0].shares(Tier::Standard);
        assert!(shares.cap == 1.0 && shares.brownout == 1.0);
        assert!(shares.fallback > 0.0 && shares.fallback < 1.0, "{shares:?}");
        let mut moved = 0;
        for ticket in 0..1000 {
            let d = decide(&s, &rules, &facts(Tier::Standard, ticket));
            assert_eq!(d, decide(&s, &rules, &facts(Tier::Standard, ticket)));
            match d.action {
                Action::Fallback { max_tokens } => {
                    assert_eq!(max_tokens, Some(64), "a moved request keeps its caps");
                    assert_eq!(d.pool, Pool::Fallback);
                    moved += 1;
                }
                Action::Degrade { max_tokens } => assert_eq!(max_tokens, 64),
                other => panic!("{other:?}"),
            }
        }
        let expected = shares.fallback * 1000.0;
        assert!(
            (moved as f64 - expected).abs() < 60.0,
            "{moved} vs {expected}"
        );
        // Guaranteed is untouched below its own step.
        let g = decide(&s, &rules, &facts(Tier::Guaranteed, 7));
        assert_eq!(g.action, Action::Pass);
    }

    /// Past its cap, Standard is capped deeper before any of it is moved or refused; the
    /// fallback step then moves requests that keep the deeper cap, and the shed step refuses
    /// only what the fallback cannot take.
    #[test]
    fn standard_is_browned_out_before_it_is_moved_or_shed() {
        use super::super::adaptive::{ladder, StepKind};
        let rules = PolicyRules::default();
        let steps = ladder(&rules, Pool::OnDemand);
        let at = |k| steps.iter().position(|s| (s.tier, s.kind) == k).unwrap();
        let b = at((Tier::Standard, StepKind::Brownout));
        assert_eq!(b, at((Tier::Standard, StepKind::Cap)) + 1);
        assert_eq!(b + 1, at((Tier::Standard, StepKind::Fallback)));
        let shed_at = at((Tier::Standard, StepKind::Shed));
        let mut s = PolicyState::initial();
        s.pools[0] = PoolControl::idle(steps);
        let decided = |s: &PolicyState| -> Vec<(Action, Reason)> {
            (0..1000)
                .map(|ticket| {
                    let d = decide(s, &rules, &facts(Tier::Standard, ticket));
                    (d.action, d.reason)
                })
                .collect()
        };
        let n = |v: &[(Action, Reason)], k: &(Action, Reason)| v.iter().filter(|d| *d == k).count();
        let browned = (Action::Degrade { max_tokens: 64 }, Reason::DegradeBrownout);
        let capped = (Action::Degrade { max_tokens: 256 }, Reason::DegradeHeadroom);
        let moved = (
            Action::Fallback {
                max_tokens: Some(64),
            },
            Reason::FallbackHeadroom,
        );
        let shed = (Action::Reject, Reason::ShedHeadroom);
        // Half-way into a step, its treatment takes about half of the requests and the step
        // before it the rest.
        let halfway = |level: usize, this: &(Action, Reason), before: &(Action, Reason)| {
            let mut at = s.clone();
            at.pools[0].level = level as f64 + 0.5;
            let v = decided(&at);
            let only = n(&v, this) + n(&v, before);
            assert_eq!(only, 1000, "only {this:?} and {before:?} at {level}.5");
            assert!(n(&v, this).abs_diff(500) < 60, "{} {this:?}", n(&v, this));
        };
        halfway(b, &browned, &capped);
        halfway(b + 1, &moved, &browned);
        // While the fallback is other capacity with room, the shed step moves what it would
        // refuse: the smaller model's answer is worth more to a client than a 429.
        let mut at = s.clone();
        at.pools[0].level = shed_at as f64 + 0.5;
        assert_eq!(n(&decided(&at), &moved), 1000);
        // Without it, the shed step refuses its share.
        let v: Vec<_> = (0..1000)
            .map(|ticket| {
                let no_fallback = RequestFacts {
                    fallback_available: false,
                    ..facts(Tier::Standard, ticket)
                };
                let d = decide(&at, &rules, &no_fallback);
                (d.action, d.reason)
            })
            .collect();
        assert_eq!(n(&v, &shed) + n(&v, &browned), 1000);
        assert!(n(&v, &shed).abs_diff(500) < 60, "{}", n(&v, &shed));
    }

    /// At level 0, with on-demand's cache past `fallback_pressure_at` (the sample's `filling`)
    /// and spot's not, Standard goes to the fallback whole (no cap: the level asks for none);
    /// Guaranteed and Best-Effort (no fallback) are untouched, and nothing moves once spot is
    /// filling too, on-demand is not, either's fill is unknown, or the fallback is down.
    #[test]
    fn a_filling_cache_moves_what_may_fall_back_while_the_fallback_has_room() {
        use super::super::adaptive::ladder;
        let rules = PolicyRules::default();
        let at = |od: Option<bool>, spot: Option<bool>| {
            let mut s = PolicyState::initial();
            s.pools[0] = PoolControl::idle(ladder(&rules, Pool::OnDemand));
            s.pools[0].filling = od;
            s.pools[1].filling = spot;
            s
        };
        let one = |s: &PolicyState, f: RequestFacts| {
            let d = decide(s, &rules, &f);
            (d.action, d.reason, d.pool)
        };
        let moved = (
            Action::Fallback { max_tokens: None },
            Reason::FallbackCacheFilling,
            Pool::Fallback,
        );
        let passed = |pool| (Action::Pass, Reason::AdmittedWithinHeadroom, pool);
        let n_moved = |s: &PolicyState| {
            (0..1000)
                .filter(|t| one(s, facts(Tier::Standard, *t)) == moved)
                .count()
        };
        let filling = at(Some(true), Some(false));
        assert_eq!(n_moved(&filling), 1000);
        assert_eq!(
            one(&filling, facts(Tier::Guaranteed, 1)),
            passed(Pool::OnDemand)
        );
        assert_eq!(
            one(&filling, facts(Tier::BestEffort, 1)),
            passed(Pool::Spot)
        );
        let down = RequestFacts {
            fallback_available: false,
            ..facts(Tier::Standard, 1)
        };
        assert_eq!(one(&filling, down), passed(Pool::OnDemand));
        for s in [
            at(Some(false), Some(false)),
            at(Some(true), Some(true)),
            at(Some(true), None),
            at(None, Some(false)),
        ] {
            assert_eq!(n_moved(&s), 0);
        }
    }

    /// `reserve_guaranteed_pool` (shipped on): while Guaranteed's pool is busy and its TTFT
    /// target is tight (under `reserve_ttft_below_x` times its unloaded TTFT, or that unknown),
    /// Standard moves to a calm fallback or is refused. A quiet pool, a loose target, no TTFT
    /// objective, Guaranteed and Best-Effort, the fallback down, the cache unknown and the knob
    /// off all leave the ladder as it was.
    #[test]
    fn a_busy_pool_with_a_tight_first_token_target_is_kept_for_guaranteed() {
        use super::super::adaptive::{ladder, DimReading};
        use crate::slo::Dim;
        let rules = PolicyRules::default();
        assert!(rules.adaptive.reserves_guaranteed_pool());
        // On-demand busy or not, Guaranteed's TTFT (target, learned unloaded); spot's level
        // and fill.
        let at = |busy: bool, ttft: (Option<u64>, Option<f64>), spot: (f64, Option<bool>)| {
            let mut s = PolicyState::initial();
            s.pools[0] = PoolControl::idle(ladder(&rules, Pool::OnDemand));
            s.pools[0].filling = Some(false);
            s.pools[0].busy = busy;
            s.pools[0].dims[Tier::Guaranteed.index()][Dim::Ttft.index()] = DimReading {
                target_ms: ttft.0,
                unloaded_ms: ttft.1,
                ..DimReading::default()
            };
            s.pools[1].level = spot.0;
            s.pools[1].filling = spot.1;
            s
        };
        let one = |r: &PolicyRules, s: &PolicyState, f: RequestFacts| {
            let d = decide(s, r, &f);
            (d.action, d.reason, d.pool)
        };
        let moved = (
            Action::Fallback { max_tokens: None },
            Reason::FallbackPoolReserved,
            Pool::Fallback,
        );
        let refused = (Action::Reject, Reason::RejectPoolReserved, Pool::OnDemand);
        let passed = |pool| (Action::Pass, Reason::AdmittedWithinHeadroom, pool);
        let tight = (Some(500), Some(200.0));
        let calm = (0.0, Some(false));
        let busy = at(true, tight, calm);
        for t in 0..200 {
            assert_eq!(one(&rules, &busy, facts(Tier::Standard, t)), moved);
        }
        for spot in [(0.25, Some(false)), (0.0, Some(true)), (0.0, None)] {
            let s = at(true, tight, spot);
            assert_eq!(one(&rules, &s, facts(Tier::Standard, 1)), refused);
        }
        // Not learned yet: the pool may have been met busy, so it counts as tight.
        let unlearned = at(true, (Some(500), None), calm);
        assert_eq!(one(&rules, &unlearned, facts(Tier::Standard, 1)), moved);
        let standard = |s: &PolicyState| one(&rules, s, facts(Tier::Standard, 1));
        // Spot's batch already spends half a tier's pace budget: nothing is moved onto it.
        let mut spot_pacing = busy.clone();
        spot_pacing.pools[1].pace_busy = true;
        assert_eq!(standard(&spot_pacing), refused);
        assert_eq!(standard(&at(false, tight, calm)), passed(Pool::OnDemand));
        let loose = at(true, (Some(500), Some(50.0)), calm);
        assert_eq!(standard(&loose), passed(Pool::OnDemand));
        assert_eq!(
            standard(&at(true, (None, Some(50.0)), calm)),
            passed(Pool::OnDemand)
        );
        let mut always = rules.clone();
        always.adaptive.reserve_ttft_below_x = None;
        assert_eq!(one(&always, &loose, facts(Tier::Standard, 1)), moved);
        assert_eq!(
            one(&rules, &busy, facts(Tier::Guaranteed, 1)),
            passed(Pool::OnDemand)
        );
        assert_eq!(
            one(&rules, &busy, facts(Tier::BestEffort, 1)),
            passed(Pool::Spot)
        );
        let down = RequestFacts {
            fallback_available: false,
            ..facts(Tier::Standard, 1)
        };
        assert_eq!(one(&rules, &busy, down), passed(Pool::OnDemand));
        let mut unknown = busy.clone();
        unknown.pools[0].filling = None;
        assert_eq!(standard(&unknown), passed(Pool::OnDemand));
        let mut off = rules.clone();
        off.adaptive.reserve_guaranteed_pool = Some(false);
        assert_eq!(
            one(&off, &busy, facts(Tier::Standard, 1)),
            passed(Pool::OnDemand)
        );
    }

    /// `guaranteed_overflow_to_spot`: Guaranteed leaves its busy pool for a calm, healthy spot
    /// pool that is other capacity, and only then; the lower tiers keep their routes.
    #[test]
    fn guaranteed_overflows_to_a_calm_spot_pool_only_while_its_own_is_busy() {
        use super::super::adaptive::ladder;
        let mut rules = PolicyRules::default();
        rules.adaptive.guaranteed_overflow_to_spot = true;
        rules.tiers[Tier::Guaranteed.index()].slo.tpot_ms = Some(50);
        let at = |od_busy: bool, spot_level: f64, spot_busy: bool| {
            let mut s = PolicyState::initial();
            s.pools[0] = PoolControl::idle(ladder(&rules, Pool::OnDemand));
            s.pools[1] = PoolControl::idle(ladder(&rules, Pool::Spot));
            s.pools[0].busy = od_busy;
            s.pools[1].level = spot_level;
            s.pools[1].busy = spot_busy;
            s
        };
        let route = |r: &PolicyRules, s: &PolicyState, f: RequestFacts| {
            let d = decide(s, r, &f);
            (d.action, d.pool, d.route_reason)
        };
        let g = || RequestFacts {
            spot_healthy: true,
            ..facts(Tier::Guaranteed, 1)
        };
        let over = (Action::Pass, Pool::Spot, Reason::RouteGuaranteedOverflow);
        let home = (Action::Pass, Pool::OnDemand, Reason::RouteTierPool);
        assert_eq!(route(&rules, &at(true, 0.0, false), g()), over);
        // Its own pool not busy, spot raising its level or busy, spot down, one backend for
        // both, or the knob off: it stays home.
        assert_eq!(route(&rules, &at(false, 0.0, false), g()), home);
        assert_eq!(route(&rules, &at(true, 0.5, false), g()), home);
        assert_eq!(route(&rules, &at(true, 0.0, true), g()), home);
        let down = RequestFacts {
            spot_healthy: false,
            ..g()
        };
        assert_eq!(route(&rules, &at(true, 0.0, false), down), home);
        // Spot lends only up to its lend limit: 600 tokens in flight there, a 1,000-token
        // limit, and this request's 1,024 would pass it; 200 in flight and a 300-token answer
        // would not.
        let mut full = at(true, 0.0, false);
        full.pools[1].lend_limit = Some(1_000.0);
        let heavy = RequestFacts {
            inflight_work: [0.0, 600.0],
            ..g()
        };
        assert_eq!(route(&rules, &full, heavy), home);
        let light = RequestFacts {
            inflight_work: [0.0, 200.0],
            prompt_tokens: 100,
            max_tokens: Some(200),
            ..g()
        };
        assert_eq!(route(&rules, &full, light), over);
        let mut shared = rules.clone();
        shared.spot_is_on_demand = true;
        assert_eq!(route(&shared, &at(true, 0.0, false), g()), home);
        let mut off = rules.clone();
        off.adaptive.guaranteed_overflow_to_spot = false;
        assert_eq!(route(&off, &at(true, 0.0, false), g()), home);
        // Without a TPOT objective for Guaranteed, a batch's pace costs it nothing it is
        // judged on: it stays home, as end-to-end configurations always did.
        let mut e2e = rules.clone();
        e2e.tiers[Tier::Guaranteed.index()].slo.tpot_ms = None;
        assert_eq!(route(&e2e, &at(true, 0.0, false), g()), home);
        // Standard is not moved by it: on a busy pool the reserve rule decides for it.
        let standard = RequestFacts {
            spot_healthy: true,
            ..facts(Tier::Standard, 1)
        };
        assert_ne!(route(&rules, &at(true, 0.0, false), standard).1, Pool::Spot);
    }

    /// A fallback pool whose lend limit this answer would pass takes none of it: what moves
    /// there must leave its own tenants their pace.
    #[test]
    fn a_fallback_pool_takes_no_more_than_it_can_lend() {
        let rules = PolicyRules::default();
        let mut s = guaranteed_short(None);
        let moved = |s: &PolicyState, inflight: f64| {
            (0..200)
                .filter(|ticket| {
                    let f = RequestFacts {
                        inflight_work: [0.0, inflight],
                        ..facts(Tier::Standard, *ticket)
                    };
                    decide(s, &rules, &f).pool == Pool::Fallback
                })
                .count()
        };
        assert!(moved(&s, 0.0) > 0, "{:?}", s.pools[0]);
        s.pools[1].lend_limit = Some(2_000.0);
        assert!(moved(&s, 500.0) > 0);
        assert_eq!(moved(&s, 1_500.0), 0);
    }

    #[test]
    fn a_saturated_fallback_pool_takes_no_fallback_traffic() {
        let rules = PolicyRules::default();
        // Spot's own Best-Effort traffic is over target: spot is saturated.
        let s = guaranteed_short(Some(600.0));
        assert!(s.pools[1].saturated);
        for ticket in 0..200 {
            let d = decide(&s, &rules, &facts(Tier::Standard, ticket));
            assert_ne!(d.pool, Pool::Fallback);
        }
    }

    /// The work gate: on a pool with a work limit (predicted or learned) and under pressure, a
    /// lower tier's request that would pass its share is capped to fit, else moved or refused,
    /// while Guaranteed always passes; at level 0 or without a limit nothing changes.
    #[test]
    fn the_work_gate_caps_then_refuses_lower_tiers_and_never_guaranteed() {
        let mut rules = PolicyRules::default();
        rules.adaptive.work_gate = true;
        let mut s = PolicyState::initial();
        s.pools[1].level = 0.5;
        s.pools[1].work_limit = Some(1000.0);
        let req = |tier, inflight: f64, max_tokens| RequestFacts {
            prompt_tokens: 100,
            max_tokens: Some(max_tokens),
            inflight_work: [0.0, inflight],
            ..facts(tier, 0)
        };
        // Best-Effort (share 0.7 of 1000) on spot: fits, then does not fit and has no cap.
        let d = decide(&s, &rules, &req(Tier::BestEffort, 100.0, 300));
        assert_eq!(d.reason, Reason::AdmittedWithinHeadroom);
        let d = decide(&s, &rules, &req(Tier::BestEffort, 400.0, 300));
        assert_eq!(
            (d.action, d.reason),
            (Action::Reject, Reason::RejectWorkLimit)
        );
        // Standard (share 0.9, cap 256) judged on spot's work when routed there.
        rules.tiers[Tier::Standard.index()].preferred_pool = Pool::Spot;
        let d = decide(&s, &rules, &req(Tier::Standard, 500.0, 500));
        assert_eq!(
            (d.action, d.reason),
            (
                Action::Degrade { max_tokens: 256 },
                Reason::DegradeWorkLimit
            )
        );
        rules.tiers[Tier::Guaranteed.index()].preferred_pool = Pool::Spot;
        let d = decide(&s, &rules, &req(Tier::Guaranteed, 5000.0, 500));
        assert_eq!(d.action, Action::Pass);
        s.pools[1].level = 0.0;
        let d = decide(&s, &rules, &req(Tier::BestEffort, 5000.0, 300));
        assert_eq!(d.action, Action::Pass, "no gate at level 0");
        s.pools[1].level = 0.5;
        s.pools[1].work_limit = None;
        let d = decide(&s, &rules, &req(Tier::BestEffort, 5000.0, 300));
        assert_eq!(d.action, Action::Pass, "no limit");
    }
}
