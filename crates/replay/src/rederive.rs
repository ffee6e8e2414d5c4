//! Thresholds-mode state under other rules. A tier's state and the fallback tracker depend on
//! the samples before the one a request saw (consecutive samples, cooldown, hysteresis), so
//! when the candidate's rules behind them differ from the recorded ones, they are rebuilt by
//! running a fresh policy engine with the candidate's rules over the recorded samples of each
//! replica lifetime, in sample order.
//!
//! Only samples some request saw were recorded: a sample between two requests is missing, so
//! with `consecutive_samples` above 1 or a cooldown a rebuilt transition can come a sample or
//! two later than it would have.

use super::source::Item;
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::{PolicyEngine, PoolSignals, TierState};
use std::collections::{BTreeMap, HashMap};

/// What the candidate's engine published at one recorded sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleState {
    pub tiers: [TierState; 3],
    pub fallback_active: bool,
}

/// A sample: replica, its policy clock's epoch, the sample's time on that clock.
type Key<'a> = (&'a str, u64, u64);

pub struct Rederived<'a> {
    states: HashMap<Key<'a>, SampleState>,
}

impl<'a> Rederived<'a> {
    pub fn run(items: &'a [Item], rules: &PolicyRules) -> Self {
        let mut lifetimes: BTreeMap<(&str, u64), BTreeMap<u64, [PoolSignals; 2]>> = BTreeMap::new();
        for it in items {
            let p = &it.inputs.pools;
            lifetimes
                .entry((it.replica.as_str(), it.inputs.epoch_ms))
                .or_default()
                .insert(it.inputs.sample_ms, [p[0].signals(), p[1].signals()]);
        }
        let mut states = HashMap::new();
        for ((replica, epoch), samples) in lifetimes {
            let mut engine = PolicyEngine::new(rules.clone());
            for (at, [od, spot]) in samples {
                let s = engine.observe(&od, &spot, at);
                states.insert(
                    (replica, epoch, at),
                    SampleState {
                        tiers: s.tiers,
                        fallback_active: s.fallback_active,
                    },
                );
            }
        }
        Rederived { states }
    }

    pub fn samples(&self) -> usize {
        self.states.len()
    }

    /// The state at `it`'s sample; `None` only for an item `run` was not given.
    pub fn at(&self, it: &Item) -> Option<SampleState> {
        let key = (it.replica.as_str(), it.inputs.epoch_ms, it.inputs.sample_ms);
        self.states.get(&key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::super::compare::tests::recorded;
    use super::*;
    use sluice_policy::{PolicyMode, PressureState, Tier};

    /// With every sample seen by some request, the recorded rules rebuild exactly the recorded
    /// states — under the shipped stability (two samples, a cooldown, hysteresis) and fallback
    /// tracker, where every state depends on history — and two lifetimes of one replica, whose
    /// policy clocks both start at 0, are kept apart.
    #[test]
    fn the_recorded_rules_rebuild_the_recorded_states() {
        let rules = PolicyRules {
            mode: PolicyMode::Thresholds,
            ..PolicyRules::default()
        };
        let runs: [(&str, u64, &[f64]); 3] = [
            (
                "a",
                1,
                &[
                    20.0, 72.0, 75.0, 80.0, 92.0, 95.0, 96.0, 88.0, 70.0, 66.0, 64.0, 20.0,
                ],
            ),
            ("a", 2, &[90.0, 91.0, 92.0, 50.0, 40.0, 30.0, 20.0, 10.0]),
            ("b", 1, &[61.0, 59.0, 58.0, 71.0, 71.0, 10.0]),
        ];
        let mut items = Vec::new();
        for (replica, epoch, pressures) in runs {
            let mut engine = sluice_policy::PolicyEngine::new(rules.clone());
            for (i, p) in pressures.iter().enumerate() {
                let sig = PoolSignals {
                    pressure: Some(*p),
                    ..Default::default()
                };
                let at = i as u64 * 1000;
                let s = engine.observe(&sig, &PoolSignals::default(), at);
                for tier in Tier::ALL {
                    let mut it = recorded(&s, &rules, tier, at + tier.index() as u64);
                    it.replica = replica.into();
                    it.inputs.epoch_ms = epoch;
                    items.push(it);
                }
            }
        }
        super::super::source::sort(&mut items);
        let rebuilt = Rederived::run(&items, &rules);
        assert_eq!(rebuilt.samples(), 12 + 8 + 6);
        for it in &items {
            let s = rebuilt.at(it).unwrap();
            assert_eq!(s.tiers[it.tier.index()], it.inputs.tier_state(), "{it:?}");
            assert_eq!(s.fallback_active, it.inputs.fallback_active);
        }
        let seen = |st| items.iter().any(|i| i.inputs.tier_state.state == st);
        assert!(seen(PressureState::Elevated) && seen(PressureState::Critical));
        assert!(items.iter().any(|i| i.inputs.fallback_active));
    }
}
