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
use crate::policy::tenant_policy::PolicyRules;
use crate::policy::{PolicyEngine, PoolSignals, TierState};
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
