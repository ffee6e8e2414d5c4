//! The two entry points: [`PolicyEngine::sample`] once per signal sample, [`decide`] once per
//! request.

use crate::action;
use crate::adaptive::{Outcome, PoolControl, PoolController};
use crate::adaptive_decide;
use crate::fallback::SustainedPressureTracker;
use crate::fleet::{self, FleetState, Layout, PoolLayout, PoolState};
use crate::pressure;
use crate::routing;
use crate::stability::StabilityModel;
use crate::state::{Decision, PolicyState};
use crate::tenant_policy::{self, PolicyRules};
use crate::types::{Millis, PolicyMode, PoolSignals, RequestFacts, Tier, TierState};

/// Holds the state that must persist between samples, per pool: one stability model per tier
/// and the fallback tracker (thresholds mode), the admission controller (adaptive mode).
/// Everything else is recomputed from each sample.
#[derive(Debug, Clone)]
pub struct PolicyEngine {
    rules: PolicyRules,
    layout: Layout,
    pools: Vec<PoolEngine>,
}

#[derive(Debug, Clone)]
struct PoolEngine {
    stability: [StabilityModel; 3],
    fallback: SustainedPressureTracker,
    controller: PoolController,
}

impl PoolEngine {
    fn new(rules: &PolicyRules, layout: &PoolLayout) -> Self {
        let mut controller = PoolController::new();
        controller.set_fallback_relieves(layout.fallback_relieves);
        PoolEngine {
            stability: Tier::ALL.map(|_| StabilityModel::new(rules.stability.clone())),
            fallback: SustainedPressureTracker::new(rules.fallback.clone()),
            controller,
        }
    }
}

impl PolicyEngine {
    /// The two-pool fleet (on-demand, spot).
    pub fn new(rules: PolicyRules) -> Self {
        let layout = Layout::pair(rules.spot_is_on_demand);
        Self::with_layout(rules, layout)
    }

    pub fn with_layout(rules: PolicyRules, layout: Layout) -> Self {
        let pools = layout
            .pools
            .iter()
            .map(|p| PoolEngine::new(&rules, p))
            .collect();
        Self {
            rules,
            layout,
            pools,
        }
    }

    pub fn rules(&self) -> &PolicyRules {
        &self.rules
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Replaces the rules (hot reload) while keeping each tier's current state, so a reload never
    /// resets a tier that is shedding load back to Normal.
    pub fn set_rules(&mut self, rules: PolicyRules) {
        for pool in &mut self.pools {
            for model in &mut pool.stability {
                model.set_tuning(rules.stability.clone());
            }
            pool.fallback.set_tuning(rules.fallback.clone());
        }
        self.rules = rules;
    }

    /// Replaces the layout (a pool started or stopped serving a model). A pool keeps its state
    /// across the change; pools beyond the old count start fresh.
    pub fn set_layout(&mut self, layout: Layout) {
        self.pools.truncate(layout.pools.len());
        while self.pools.len() < layout.pools.len() {
            let p = PoolEngine::new(&self.rules, &layout.pools[self.pools.len()]);
            self.pools.push(p);
        }
        for (engine, p) in self.pools.iter_mut().zip(&layout.pools) {
            engine.controller.set_fallback_relieves(p.fallback_relieves);
        }
        self.layout = layout;
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

    /// Feeds one sample of the two-pool fleet: each pool's signals and the outcomes of the
    /// requests it served since the previous sample (by [`Pool::signal_index`]).
    pub fn sample(
        &mut self,
        signals: &PoolSignals,
        spot: &PoolSignals,
        outcomes: [&[Outcome]; 2],
        now: Millis,
    ) -> PolicyState {
        let mut fleet = self.sample_fleet(&[*signals, *spot], &outcomes, now);
        fleet.domains.swap_remove(0)
    }

    /// Feeds one sample of every pool (by index in the layout): its signals and the outcomes of
    /// the requests it served since the previous sample.
    pub fn sample_fleet(
        &mut self,
        signals: &[PoolSignals],
        outcomes: &[&[Outcome]],
        now: Millis,
    ) -> FleetState {
        let rules = &self.rules;
        let layout = &self.layout;
        let n = layout.pools.len();
        let signal = |i: usize| signals.get(i).copied().unwrap_or_default();
        let outcome = |i: usize| outcomes.get(i).copied().unwrap_or(&[]);
        let mut controls: Vec<Option<PoolControl>> = vec![None; n];
        for i in 0..n {
            if layout.pools[i].shares_with.is_some() {
                continue;
            }
            let sharers: Vec<usize> = (0..n)
                .filter(|&k| layout.pools[k].shares_with == Some(i))
                .collect();
            let class = layout.pools[i].class;
            let tuning = &rules.adaptive;
            let control = if sharers.is_empty() {
                let own = signal(i);
                self.pools[i]
                    .controller
                    .observe(class, rules, tuning, &own, outcome(i), now)
            } else {
                let mut all: Vec<Outcome> = outcome(i).to_vec();
                let mut work = signal(i).inflight_work;
                for &k in &sharers {
                    all.extend_from_slice(outcome(k));
                    work = work.zip(signal(k).inflight_work).map(|(a, b)| a + b);
                }
                let merged = PoolSignals {
                    inflight_work: work,
                    ..signal(i)
                };
                self.pools[i]
                    .controller
                    .observe(class, rules, tuning, &merged, &all, now)
            };
            for &k in &sharers {
                controls[k] = Some(control.clone());
            }
            controls[i] = Some(control);
        }
        let pools: Vec<PoolState> = (0..n)
            .map(|i| {
                let s = signal(i);
                let engine = &mut self.pools[i];
                let tiers = Tier::ALL.map(|tier| {
                    let raw =
                        pressure::evaluate(&rules.tier(tier).thresholds, &s, &rules.stability);
                    let model = &mut engine.stability[tier.index()];
                    let state = model.observe(&raw, now);
                    TierState {
                        tier,
                        state,
                        driver: model.driver(),
                        fail_open: raw.all_unavailable,
                        pressure_unavailable: s.pressure.is_none(),
                    }
                });
                PoolState {
                    class: layout.pools[i].class,
                    signals: s,
                    tiers,
                    fallback_active: engine.fallback.observe(s.pressure, now),
                    eviction: pressure::evaluate(&rules.spot_eviction, &s, &rules.stability)
                        .escalate,
                    control: controls[i]
                        .take()
                        .unwrap_or_else(|| PoolControl::idle(Vec::new())),
                }
            })
            .collect();
        let domains = layout
            .domains
            .iter()
            .map(|d| {
                let mut state = fleet::domain(&pools, d, now);
                if rules.mode == PolicyMode::Adaptive {
                    adaptive_decide::tier_states(rules, &state.pools, &mut state.tiers);
                }
                state
            })
            .collect();
        FleetState {
            pools,
            domains,
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
    use crate::{Action, Pool, PressureState, Reason};

    /// The prototype's policy: these tests pin its behaviour in `thresholds` mode.
    fn thresholds() -> PolicyRules {
        PolicyRules {
            mode: PolicyMode::Thresholds,
            ..PolicyRules::default()
        }
    }

    fn facts(tier: Tier) -> RequestFacts {
        RequestFacts::of(tier)
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
