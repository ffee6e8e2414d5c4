//! Stage 5, ClusterRouting: a QoS choice between pools, never load balancing across them.
//! Guaranteed and Standard go on-demand; Best-Effort prefers spot unless spot has no healthy
//! backend or its own pressure is Critical, in which case it is evicted to on-demand.

use crate::reason::Reason;
use crate::tenant_policy::TierPlan;
use crate::types::{Action, Pool, PressureState};

pub fn route(
    plan: &TierPlan,
    action: &Action,
    spot_state: PressureState,
    spot_healthy: bool,
) -> (Pool, Reason) {
    if matches!(action, Action::Fallback { .. }) {
        return (Pool::Fallback, Reason::RouteFallback);
    }
    match plan.preferred_pool {
        Pool::Spot if !spot_healthy => (Pool::OnDemand, Reason::RouteSpotUnhealthy),
        Pool::Spot if spot_state == PressureState::Critical => {
            (Pool::OnDemand, Reason::RouteSpotPressure)
        }
        pool => (pool, Reason::RouteTierPool),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant_policy::Intervention;

    fn plan(pool: Pool) -> TierPlan {
        TierPlan {
            intervention: Intervention::None(Reason::BelowTierThreshold),
            queue_eligible: false,
            preferred_pool: pool,
        }
    }

    #[test]
    fn spot_eviction_rules() {
        use PressureState::*;
        let be = plan(Pool::Spot);
        assert_eq!(
            route(&be, &Action::Pass, Normal, true),
            (Pool::Spot, Reason::RouteTierPool)
        );
        assert_eq!(
            route(&be, &Action::Pass, Normal, false),
            (Pool::OnDemand, Reason::RouteSpotUnhealthy)
        );
        assert_eq!(
            route(&be, &Action::Pass, Critical, true),
            (Pool::OnDemand, Reason::RouteSpotPressure)
        );
        assert_eq!(route(&be, &Action::Pass, Elevated, true).0, Pool::Spot);
        let g = plan(Pool::OnDemand);
        assert_eq!(
            route(&g, &Action::Pass, Normal, false),
            (Pool::OnDemand, Reason::RouteTierPool)
        );
        let fb = Action::Fallback { max_tokens: None };
        assert_eq!(
            route(&g, &fb, Normal, true),
            (Pool::Fallback, Reason::RouteFallback)
        );
    }
}
