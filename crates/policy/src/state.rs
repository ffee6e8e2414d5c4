//! What the policy publishes: the state one sample produced, shared with the request path, and
//! the answer for one request.

use crate::adaptive::PoolControl;
use crate::reason::Reason;
use crate::types::{Action, Millis, Pool, PoolSignals, PressureState, SignalKind, Tier, TierState};

/// The immutable result of one [`crate::PolicyEngine::observe`], shared with the request path.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyState {
    pub tiers: [TierState; 3],
    /// Adaptive mode: each pool's admission control (on-demand, spot), by [`Pool::signal_index`].
    pub pools: [PoolControl; 2],
    pub fallback_active: bool,
    /// Spot pool's own severity against the eviction thresholds.
    pub spot_state: PressureState,
    pub signals: PoolSignals,
    pub spot_signals: PoolSignals,
    pub at: Millis,
}

impl PolicyState {
    /// The state before any sample has been observed: everything unavailable, fail open.
    pub fn initial() -> Self {
        let tiers = Tier::ALL.map(|tier| TierState {
            tier,
            state: PressureState::Normal,
            driver: SignalKind::Pressure,
            fail_open: true,
            pressure_unavailable: true,
        });
        PolicyState {
            tiers,
            pools: [PoolControl::idle(Vec::new()), PoolControl::idle(Vec::new())],
            fallback_active: false,
            spot_state: PressureState::Normal,
            signals: PoolSignals::default(),
            spot_signals: PoolSignals::default(),
            at: 0,
        }
    }

    pub fn tier(&self, tier: Tier) -> &TierState {
        &self.tiers[tier.index()]
    }
}

/// The policy's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub tier: Tier,
    pub state: PressureState,
    pub action: Action,
    pub reason: Reason,
    pub pool: Pool,
    pub route_reason: Reason,
    /// When the tier's in-flight capacity is full, wait in the queue rather than reject.
    pub queue_eligible: bool,
}
