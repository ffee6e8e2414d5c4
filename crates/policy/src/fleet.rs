//! A fleet of any number of pools. Each pool keeps its own state from sample to sample (its
//! signals' tier states and sustained-pressure tracker, its spot eviction state, its adaptive
//! controller); a request is decided against its *domain*: the pool of its model that serves
//! on-demand traffic and the one that serves spot traffic, seen together as the two-pool
//! [`PolicyState`] the per-request rules were written for.

use crate::adaptive::PoolControl;
use crate::state::PolicyState;
use crate::types::{Millis, Pool, PoolSignals, PressureState, TierState};

/// How the fleet's pools relate; fixed until the set of models a pool serves changes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Layout {
    pub pools: Vec<PoolLayout>,
    pub domains: Vec<Domain>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolLayout {
    /// On-demand pools drive tier states; spot pools drive eviction.
    pub class: Pool,
    /// This pool lists the same backends as that (earlier) pool: one capacity, governed by that
    /// pool's controller with both pools' outcomes and work.
    pub shares_with: Option<usize>,
    /// Moving traffic to the fallback model takes load off this pool (the fallback runs
    /// elsewhere); `None` leaves it to the rules' two-pool view.
    pub fallback_relieves: Option<bool>,
}

/// The pools one request is judged on: its model's on-demand pool (or, for a model only spot
/// serves, its spot pool) and its model's spot pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Domain {
    pub primary: usize,
    pub spot: Option<usize>,
}

impl Layout {
    /// The two-pool fleet: on-demand (0) and spot (1), one domain over both.
    pub fn pair(spot_is_on_demand: bool) -> Self {
        Layout {
            pools: vec![
                PoolLayout {
                    class: Pool::OnDemand,
                    shares_with: None,
                    fallback_relieves: None,
                },
                PoolLayout {
                    class: Pool::Spot,
                    shares_with: spot_is_on_demand.then_some(0),
                    fallback_relieves: None,
                },
            ],
            domains: vec![Domain {
                primary: 0,
                spot: Some(1),
            }],
        }
    }
}

/// One pool's part of a sample.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolState {
    pub class: Pool,
    pub signals: PoolSignals,
    /// Thresholds mode's tier states on this pool's signals.
    pub tiers: [TierState; 3],
    pub fallback_active: bool,
    /// This pool's severity against the spot eviction thresholds.
    pub eviction: PressureState,
    pub control: PoolControl,
}

/// The result of one sample over the whole fleet: each pool, and each domain as the two-pool
/// state a request is decided on (built once per sample, not per request).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetState {
    pub pools: Vec<PoolState>,
    pub domains: Vec<PolicyState>,
    pub at: Millis,
}

impl FleetState {
    /// Before any sample: every pool idle with its ladder, every domain failing open.
    pub fn initial(layout: &Layout, ladders: impl Fn(usize) -> Vec<crate::adaptive::Step>) -> Self {
        let initial = PolicyState::initial();
        let pools: Vec<PoolState> = layout
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| PoolState {
                class: p.class,
                signals: PoolSignals::default(),
                tiers: initial.tiers,
                fallback_active: false,
                eviction: PressureState::Normal,
                control: PoolControl::idle(ladders(i)),
            })
            .collect();
        let domains = layout
            .domains
            .iter()
            .map(|d| domain(&pools, d, 0))
            .collect();
        FleetState {
            pools,
            domains,
            at: 0,
        }
    }
}

/// The two-pool state of one domain: tier states and sustained pressure from its primary
/// pool, eviction from its spot pool.
pub(crate) fn domain(pools: &[PoolState], d: &Domain, at: Millis) -> PolicyState {
    let primary = &pools[d.primary];
    let spot = d.spot.and_then(|i| pools.get(i));
    let idle_spot = || PoolControl::idle(Vec::new());
    PolicyState {
        tiers: primary.tiers,
        pools: [
            primary.control.clone(),
            spot.map_or_else(idle_spot, |s| s.control.clone()),
        ],
        fallback_active: primary.fallback_active,
        spot_state: spot.map_or(PressureState::Normal, |s| s.eviction),
        signals: primary.signals,
        spot_signals: spot.map(|s| s.signals).unwrap_or_default(),
        at,
    }
}
