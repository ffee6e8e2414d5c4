//! Stage 4, ActionSelection: the tier's plan plus the request's facts → one action and reason.
//! Tier-agnostic by construction: it never looks at which tier the request is.

use crate::reason::Reason;
use crate::tenant_policy::{Intervention, TierPlan};
use crate::types::{Action, RequestFacts, TierState};

pub fn select(plan: &TierPlan, _state: &TierState, req: &RequestFacts) -> (Action, Reason) {
    if !req.shapeable {
        return (Action::Pass, Reason::EndpointNotShapeable);
    }
    match &plan.intervention {
        Intervention::None(reason) => (Action::Pass, *reason),
        Intervention::Reject(reason) => (Action::Reject, *reason),
        Intervention::Degrade { max_tokens, reason } => (
            Action::Degrade {
                max_tokens: *max_tokens,
            },
            *reason,
        ),
        Intervention::Fallback { max_tokens, .. } if req.fallback_available => (
            Action::Fallback {
                max_tokens: *max_tokens,
            },
            Reason::FallbackSustainedPressure,
        ),
        // No usable fallback backend: Critical rejects, Elevated caps.
        Intervention::Fallback {
            critical: Some(reason),
            ..
        } => (Action::Reject, *reason),
        Intervention::Fallback {
            max_tokens: Some(max_tokens),
            ..
        } => (
            Action::Degrade {
                max_tokens: *max_tokens,
            },
            Reason::DegradePressure,
        ),
        Intervention::Fallback {
            max_tokens: None, ..
        } => (Action::Pass, Reason::BelowTierThreshold),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Pool, PressureState, SignalKind, Tier};

    fn facts(shapeable: bool, fallback_available: bool) -> RequestFacts {
        RequestFacts {
            shapeable,
            fallback_available,
            ..RequestFacts::of(Tier::Standard)
        }
    }

    fn plan(i: Intervention) -> TierPlan {
        TierPlan {
            intervention: i,
            queue_eligible: true,
            preferred_pool: Pool::OnDemand,
        }
    }

    const STATE: TierState = TierState {
        tier: Tier::Standard,
        state: PressureState::Elevated,
        driver: SignalKind::Pressure,
        fail_open: false,
        pressure_unavailable: false,
    };

    #[test]
    fn non_shapeable_passes_untouched_even_when_critical() {
        let p = plan(Intervention::Reject(Reason::RejectPressure));
        assert_eq!(
            select(&p, &STATE, &facts(false, false)),
            (Action::Pass, Reason::EndpointNotShapeable)
        );
    }

    #[test]
    fn fallback_needs_an_available_backend() {
        let p = plan(Intervention::Fallback {
            max_tokens: Some(256),
            critical: None,
        });
        assert_eq!(
            select(&p, &STATE, &facts(true, true)),
            (
                Action::Fallback {
                    max_tokens: Some(256)
                },
                Reason::FallbackSustainedPressure
            )
        );
        assert_eq!(
            select(&p, &STATE, &facts(true, false)),
            (Action::Degrade { max_tokens: 256 }, Reason::DegradePressure)
        );
        let critical = plan(Intervention::Fallback {
            max_tokens: Some(256),
            critical: Some(Reason::RejectPressure),
        });
        assert_eq!(
            select(&critical, &STATE, &facts(true, false)),
            (Action::Reject, Reason::RejectPressure),
            "Critical without a usable fallback rejects"
        );
    }
}
