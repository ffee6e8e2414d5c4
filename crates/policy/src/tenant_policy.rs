//! Stage 3, TenantPolicy: the one place that knows what each tier is owed. It holds every
//! tier-specific rule (thresholds, caps, queue eligibility, fallback eligibility, pool preference,
//! SLA target, capacity) and turns a tier's state into a [`TierPlan`]. The stages after it are
//! tier-agnostic.

use crate::fallback::FallbackTuning;
use crate::pressure::{Threshold, Thresholds};
use crate::reason::Reason;
use crate::slo::Slo;
use crate::tuning::{AdaptiveTuning, StabilityTuning};
use crate::types::{PolicyMode, Pool, PressureState, Tier, TierState};

#[derive(Debug, Clone, PartialEq)]
pub struct TierRules {
    pub thresholds: Thresholds,
    /// The Elevated-state degrade step; `None` means the tier has none (Best-Effort).
    pub max_tokens_cap: Option<u32>,
    /// Adaptive mode's deeper cap (brownout), the step after the tier's cap and before it is
    /// moved or shed: under overload a short answer in time instead of a 429. `None`: no
    /// such step.
    pub brownout_max_tokens: Option<u32>,
    /// At capacity, wait in the tier's queue instead of being rejected.
    pub queue_eligible: bool,
    /// May be rewritten to the fallback model under sustained pressure.
    pub fallback_eligible: bool,
    pub preferred_pool: Pool,
    /// The tier's objective: TTFT, TPOT and end-to-end targets, any subset
    /// (`tiers.<tier>.slo`; `sla_target_ms` is its end-to-end target).
    pub slo: Slo,
    /// In-flight requests across the tier; 0 = unlimited.
    pub inflight_capacity: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRules {
    pub mode: PolicyMode,
    /// Indexed by [`Tier::index`].
    pub tiers: [TierRules; 3],
    pub adaptive: AdaptiveTuning,
    pub stability: StabilityTuning,
    pub fallback: FallbackTuning,
    /// Thresholds on the spot pool's own signals; Critical evicts Best-Effort to on-demand.
    pub spot_eviction: Thresholds,
    /// Spot lists the same backends as on-demand: one capacity, so adaptive mode governs both
    /// pools with on-demand's controller (a tier on "spot" is then shed for a tier above it).
    pub spot_is_on_demand: bool,
    /// Where the fallback model runs: adaptive mode only moves a pool's traffic to it when it
    /// is other capacity than the pool's own.
    pub fallback_capacity: FallbackCapacity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackCapacity {
    /// No fallback configured.
    None,
    /// Backends of its own.
    Separate,
    /// A backend of this pool.
    On(Pool),
}

impl PolicyRules {
    /// Moving pool `pool`'s traffic to the fallback sheds load from it (adaptive mode).
    pub fn fallback_relieves(&self, pool: Pool) -> bool {
        let same = |p: Pool| {
            p == pool || (self.spot_is_on_demand && matches!(p, Pool::OnDemand | Pool::Spot))
        };
        match self.fallback_capacity {
            FallbackCapacity::None => false,
            FallbackCapacity::Separate => true,
            FallbackCapacity::On(p) => !same(p),
        }
    }
}

impl PolicyRules {
    pub fn tier(&self, tier: Tier) -> &TierRules {
        &self.tiers[tier.index()]
    }
}

impl Default for PolicyRules {
    /// The seed's thresholds for KV pressure; queue-depth and SLA-rate thresholds are ours
    /// (see the README's policy table for why).
    fn default() -> Self {
        let guaranteed = TierRules {
            thresholds: Thresholds {
                pressure: Threshold::new(Some(95.0), Some(100.0)),
                queue_depth: Threshold::new(Some(64.0), None),
                sla_violation_rate: Threshold::new(Some(0.10), None),
            },
            max_tokens_cap: Some(512),
            brownout_max_tokens: None,
            queue_eligible: false,
            fallback_eligible: false,
            preferred_pool: Pool::OnDemand,
            slo: Slo::e2e(2000),
            inflight_capacity: 0,
        };
        let standard = TierRules {
            thresholds: Thresholds {
                pressure: Threshold::new(Some(70.0), Some(90.0)),
                queue_depth: Threshold::new(Some(16.0), Some(64.0)),
                sla_violation_rate: Threshold::new(Some(0.20), Some(0.50)),
            },
            max_tokens_cap: Some(256),
            brownout_max_tokens: Some(64),
            queue_eligible: true,
            fallback_eligible: true,
            preferred_pool: Pool::OnDemand,
            slo: Slo::e2e(1000),
            inflight_capacity: 0,
        };
        let best_effort = TierRules {
            thresholds: Thresholds {
                pressure: Threshold::new(None, Some(60.0)),
                queue_depth: Threshold::new(None, Some(8.0)),
                sla_violation_rate: Threshold::new(None, Some(0.30)),
            },
            max_tokens_cap: None,
            brownout_max_tokens: None,
            queue_eligible: false,
            fallback_eligible: false,
            preferred_pool: Pool::Spot,
            slo: Slo::e2e(500),
            inflight_capacity: 0,
        };
        PolicyRules {
            mode: PolicyMode::default(),
            tiers: [guaranteed, standard, best_effort],
            adaptive: AdaptiveTuning::default(),
            stability: StabilityTuning::default(),
            fallback: FallbackTuning::default(),
            spot_eviction: Thresholds {
                pressure: Threshold::new(None, Some(90.0)),
                queue_depth: Threshold::new(None, Some(32.0)),
                sla_violation_rate: Threshold::default(),
            },
            spot_is_on_demand: false,
            fallback_capacity: FallbackCapacity::Separate,
        }
    }
}

/// What the tier's rules call for in its current state, before looking at the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Intervention {
    None(Reason),
    Degrade {
        max_tokens: u32,
        reason: Reason,
    },
    /// The fallback model, with the tier's cap when it is Elevated or Critical. `critical` is
    /// the rejection to fall back to when the tier is Critical and no fallback backend is usable.
    Fallback {
        max_tokens: Option<u32>,
        critical: Option<Reason>,
    },
    Reject(Reason),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierPlan {
    pub intervention: Intervention,
    pub queue_eligible: bool,
    pub preferred_pool: Pool,
}

pub fn plan(rules: &PolicyRules, state: &TierState, fallback_active: bool) -> TierPlan {
    let tier = rules.tier(state.tier);
    let elevated_cap = |s: PressureState| match s {
        PressureState::Elevated => tier.max_tokens_cap,
        _ => None,
    };
    let intervention = if state.fail_open {
        Intervention::None(Reason::SignalsUnavailableFailOpen)
    } else if tier.fallback_eligible && (fallback_active || state.state == PressureState::Critical)
    {
        // In Critical the choice is a 429 or the fallback model, which runs on other capacity
        // than the pool under pressure and so sheds the same load: it needs no further proof
        // that the pressure is sustained (that bar keeps Elevated traffic on the big model).
        let critical = state.state == PressureState::Critical;
        Intervention::Fallback {
            max_tokens: if critical {
                tier.max_tokens_cap
            } else {
                elevated_cap(state.state)
            },
            critical: critical.then(|| Reason::reject(state.driver)),
        }
    } else if state.state == PressureState::Critical {
        Intervention::Reject(Reason::reject(state.driver))
    } else if state.state == PressureState::Elevated {
        match tier.max_tokens_cap {
            Some(max_tokens) => Intervention::Degrade {
                max_tokens,
                reason: Reason::degrade(state.driver),
            },
            None => Intervention::None(Reason::ElevatedNoShaping),
        }
    } else if state.pressure_unavailable {
        Intervention::None(Reason::CachePressureUnavailableFailOpen)
    } else {
        Intervention::None(Reason::BelowTierThreshold)
    };
    TierPlan {
        intervention,
        queue_eligible: tier.queue_eligible,
        preferred_pool: tier.preferred_pool,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SignalKind;

    fn state(tier: Tier, s: PressureState) -> TierState {
        TierState {
            tier,
            state: s,
            driver: SignalKind::Pressure,
            fail_open: false,
            pressure_unavailable: false,
        }
    }

    #[test]
    fn each_tier_gets_its_own_ladder() {
        let r = PolicyRules::default();
        use PressureState::*;
        assert_eq!(
            plan(&r, &state(Tier::Standard, Elevated), false).intervention,
            Intervention::Degrade {
                max_tokens: 256,
                reason: Reason::DegradePressure
            }
        );
        assert_eq!(
            plan(&r, &state(Tier::Guaranteed, Elevated), false).intervention,
            Intervention::Degrade {
                max_tokens: 512,
                reason: Reason::DegradePressure
            }
        );
        assert_eq!(
            plan(&r, &state(Tier::BestEffort, Elevated), false).intervention,
            Intervention::None(Reason::ElevatedNoShaping),
            "Best-Effort has no degrade step"
        );
        assert_eq!(
            plan(&r, &state(Tier::BestEffort, Critical), false).intervention,
            Intervention::Reject(Reason::RejectPressure)
        );
        assert!(plan(&r, &state(Tier::Standard, Normal), false).queue_eligible);
        assert!(!plan(&r, &state(Tier::Guaranteed, Normal), false).queue_eligible);
        assert_eq!(
            plan(&r, &state(Tier::BestEffort, Normal), false).preferred_pool,
            Pool::Spot
        );
    }

    #[test]
    fn fallback_only_for_eligible_tiers_and_in_critical_before_rejecting() {
        let r = PolicyRules::default();
        use PressureState::*;
        assert_eq!(
            plan(&r, &state(Tier::Standard, Elevated), true).intervention,
            Intervention::Fallback {
                max_tokens: Some(256),
                critical: None
            }
        );
        assert_eq!(
            plan(&r, &state(Tier::Guaranteed, Elevated), true).intervention,
            Intervention::Degrade {
                max_tokens: 512,
                reason: Reason::DegradePressure
            }
        );
        assert_eq!(
            plan(&r, &state(Tier::Standard, Critical), true).intervention,
            Intervention::Fallback {
                max_tokens: Some(256),
                critical: Some(Reason::RejectPressure)
            }
        );
        assert_eq!(
            plan(&r, &state(Tier::Standard, Critical), false).intervention,
            Intervention::Fallback {
                max_tokens: Some(256),
                critical: Some(Reason::RejectPressure)
            },
            "Critical needs no sustained-pressure proof to prefer the fallback to a 429"
        );
        assert_eq!(
            plan(&r, &state(Tier::Guaranteed, Critical), true).intervention,
            Intervention::Reject(Reason::RejectPressure),
            "a tier that may not fall back is rejected in Critical"
        );
    }

    #[test]
    fn fail_open_and_partial_signals_are_explained() {
        let r = PolicyRules::default();
        let mut s = state(Tier::Standard, PressureState::Normal);
        s.fail_open = true;
        assert_eq!(
            plan(&r, &s, false).intervention,
            Intervention::None(Reason::SignalsUnavailableFailOpen)
        );
        s.fail_open = false;
        s.pressure_unavailable = true;
        assert_eq!(
            plan(&r, &s, false).intervention,
            Intervention::None(Reason::CachePressureUnavailableFailOpen)
        );
    }
}
