//! The two entry points: [`PolicyEngine::sample`] once per signal sample, [`decide`] once per
//! request.

use crate::action;
use crate::adaptive::{Outcome, PoolControl, PoolController};
use crate::adaptive_decide;
use crate::fallback::SustainedPressureTracker;
use crate::pressure;
use crate::routing;
use crate::stability::StabilityModel;
use crate::state::{Decision, PolicyState};
use crate::tenant_policy::{self, PolicyRules};
use crate::types::{Millis, PolicyMode, Pool, PoolSignals, RequestFacts, Tier, TierState};

/// Holds the state that must persist between samples: one stability model per tier and the
/// fallback tracker (thresholds mode), one admission controller per pool (adaptive mode).
/// Everything else is recomputed from each sample.
#[derive(Debug, Clone)]
pub struct PolicyEngine {
    rules: PolicyRules,
    stability: [StabilityModel; 3],
    fallback: SustainedPressureTracker,
    controllers: [PoolController; 2],
}

impl PolicyEngine {
    pub fn new(rules: PolicyRules) -> Self {
        let stability = Tier::ALL.map(|_| StabilityModel::new(rules.stability.clone()));
        let fallback = SustainedPressureTracker::new(rules.fallback.clone());
        Self {
            rules,
            stability,
            fallback,
            controllers: Default::default(),
        }
    }

    pub fn rules(&self) -> &PolicyRules {
        &self.rules
    }

    /// Replaces the rules (hot reload) while keeping each tier's current state, so a reload never
    /// resets a tier that is shedding load back to Normal.
    pub fn set_rules(&mut self, rules: PolicyRules) {
        for model in &mut self.stability {
            model.set_tuning(rules.stability.clone());
        }
        self.fallback.set_tuning(rules.fallback.clone());
        self.rules = rules;
    }

    /// Feeds one sample of the signals (on-demand pool for tier states, spot pool for eviction)
    /// with no request outcomes.
    pub fn observe(
        &mut self,
        signals: &PoolSignals,
        spot: &PoolSignals,
        now: Millis,
    ) -> PolicyState {
        self.sample(signals, spot, [&[], &[]], now)
    }

    /// Feeds one sample: each pool's signals and the outcomes of the requests it served since
    /// the previous sample (by [`Pool::signal_index`]).
    pub fn sample(
        &mut self,
        signals: &PoolSignals,
        spot: &PoolSignals,
        outcomes: [&[Outcome]; 2],
        now: Millis,
    ) -> PolicyState {
        let (rules, [od, sp]) = (&self.rules, &mut self.controllers);
        let pools = if rules.spot_is_on_demand {
            let both: Vec<Outcome> = outcomes.concat();
            let work = signals.inflight_work.zip(spot.inflight_work);
            let signals = &PoolSignals {
                inflight_work: work.map(|(a, b)| a + b),
                ..*signals
            };
            let one = od.observe(Pool::OnDemand, rules, &rules.adaptive, signals, &both, now);
            [one.clone(), one]
        } else {
            [
                od.observe(
                    Pool::OnDemand,
                    rules,
                    &rules.adaptive,
                    signals,
                    outcomes[0],
                    now,
                ),
                sp.observe(Pool::Spot, rules, &rules.adaptive, spot, outcomes[1], now),
            ]
        };
        let mut state = self.threshold_state(signals, spot, now);
        if self.rules.mode == PolicyMode::Adaptive {
            adaptive_decide::tier_states(&self.rules, &pools, &mut state.tiers);
        }
        state.pools = pools;
        state
    }

    fn threshold_state(
        &mut self,
        signals: &PoolSignals,
        spot: &PoolSignals,
        now: Millis,
    ) -> PolicyState {
        let tiers = Tier::ALL.map(|tier| {
            let rules = self.rules.tier(tier);
            let raw = pressure::evaluate(&rules.thresholds, signals, &self.rules.stability);
            let model = &mut self.stability[tier.index()];
            let state = model.observe(&raw, now);
            TierState {
                tier,
                state,
                driver: model.driver(),
                fail_open: raw.all_unavailable,
                pressure_unavailable: signals.pressure.is_none(),
            }
        });
        let fallback_active = self.fallback.observe(signals.pressure, now);
        let spot_state =
            pressure::evaluate(&self.rules.spot_eviction, spot, &self.rules.stability).escalate;
        PolicyState {
            tiers,
            pools: [PoolControl::idle(Vec::new()), PoolControl::idle(Vec::new())],
            fallback_active,
            spot_state,
            signals: *signals,
            spot_signals: *spot,
            at: now,
        }
    }
}

/// Decides one request. Pure: the same state, rules and request always give the same decision.
pub fn decide(state: &PolicyState, rules: &PolicyRules, req: &RequestFacts) -> Decision {
    if rules.mode == PolicyMode::Adaptive {
        return adaptive_decide::decide(state, rules, req);
    }
    let tier_state = &state.tiers[req.tier.index()];
    let plan = tenant_policy::plan(rules, tier_state, state.fallback_active);
    let (action, reason) = action::select(&plan, tier_state, req);
    let (pool, route_reason) = routing::route(&plan, &action, state.spot_state, req.spot_healthy);
    Decision {
        tier: req.tier,
        state: tier_state.state,
        action,
        reason,
        pool,
        route_reason,
        queue_eligible: plan.queue_eligible,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Action, PressureState, Reason};

    /// The prototype's policy: these tests pin its behaviour in `thresholds` mode.
    fn thresholds() -> PolicyRules {
        PolicyRules {
            mode: PolicyMode::Thresholds,
            ..PolicyRules::default()
        }
    }

    fn facts(tier: Tier) -> RequestFacts {
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

    fn pressure(p: f64) -> PoolSignals {
        PoolSignals {
            pressure: Some(p),
            ..Default::default()
        }
    }

    /// Drives the whole pipeline through the "done when" story in simulated time.
    #[test]
    fn pressure_story_through_the_pipeline() {
        let mut engine = PolicyEngine::new(thresholds());
        let spot = PoolSignals::default();
        let mut now = 0;
        let mut run = |p: f64, samples: u32| {
            let mut s = None;
            for _ in 0..samples {
                now += 1000;
                s = Some(engine.observe(&pressure(p), &spot, now));
            }
            s.unwrap()
        };
        let s = run(20.0, 3);
        let d = decide(&s, &thresholds(), &facts(Tier::BestEffort));
        assert_eq!(
            (d.action, d.reason, d.pool),
            (Action::Pass, Reason::BelowTierThreshold, Pool::Spot)
        );

        let s = run(65.0, 2);
        let be = decide(&s, &thresholds(), &facts(Tier::BestEffort));
        assert_eq!(
            (be.action, be.reason),
            (Action::Reject, Reason::RejectPressure)
        );
        let g = decide(&s, &thresholds(), &facts(Tier::Guaranteed));
        assert_eq!(g.action, Action::Pass);

        let s = run(75.0, 3);
        let st = decide(&s, &thresholds(), &facts(Tier::Standard));
        assert_eq!(st.action, Action::Degrade { max_tokens: 256 });
        assert_eq!(st.state, PressureState::Elevated);

        let s = run(87.0, 3);
        let st = decide(&s, &thresholds(), &facts(Tier::Standard));
        assert_eq!(
            st.action,
            Action::Fallback {
                max_tokens: Some(256)
            }
        );
        assert_eq!(st.pool, Pool::Fallback);

        let s = run(20.0, 4);
        let st = decide(&s, &thresholds(), &facts(Tier::Standard));
        assert_eq!(
            st.action,
            Action::Pass,
            "recovered: fallback released, state Normal"
        );
    }

    #[test]
    fn no_samples_fails_open() {
        let s = PolicyState::initial();
        let d = decide(&s, &thresholds(), &facts(Tier::BestEffort));
        assert_eq!(
            (d.action, d.reason),
            (Action::Pass, Reason::SignalsUnavailableFailOpen)
        );
    }

    #[test]
    fn spot_pressure_evicts_best_effort() {
        let mut engine = PolicyEngine::new(thresholds());
        let s = engine.observe(&pressure(10.0), &pressure(95.0), 1000);
        let d = decide(&s, &thresholds(), &facts(Tier::BestEffort));
        assert_eq!(
            (d.pool, d.route_reason),
            (Pool::OnDemand, Reason::RouteSpotPressure)
        );
    }
}
