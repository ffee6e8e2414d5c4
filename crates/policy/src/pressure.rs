//! Stage 1, PressureEvaluation: raw signals → a severity per tier, before stabilisation.
//!
//! The combination rule is the seed's max-severity OR over the *available* signals (never an
//! average): one signal at Critical makes the tier Critical. Unavailable signals are skipped; if
//! all are unavailable the policy fails open.

use crate::tuning::StabilityTuning;
use crate::types::{PoolSignals, PressureState, SignalKind};

/// Where one signal puts a tier. `None` disables that step for the tier.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Threshold {
    pub elevated_at: Option<f64>,
    pub critical_at: Option<f64>,
}

impl Threshold {
    pub const fn new(elevated_at: Option<f64>, critical_at: Option<f64>) -> Self {
        Self {
            elevated_at,
            critical_at,
        }
    }

    fn severity(&self, value: f64) -> PressureState {
        if self.critical_at.is_some_and(|t| value >= t) {
            PressureState::Critical
        } else if self.elevated_at.is_some_and(|t| value >= t) {
            PressureState::Elevated
        } else {
            PressureState::Normal
        }
    }
}

/// A tier's thresholds for each signal.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Thresholds {
    pub pressure: Threshold,
    pub queue_depth: Threshold,
    pub sla_violation_rate: Threshold,
}

/// The unstabilised reading of one sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawEvaluation {
    /// The severity the signals call for when moving up.
    pub escalate: PressureState,
    pub escalate_driver: SignalKind,
    /// The severity the signals still support once the hysteresis band is applied: moving down
    /// requires every signal to be below its threshold minus the band.
    pub recover: PressureState,
    pub recover_driver: SignalKind,
    pub all_unavailable: bool,
}

pub fn evaluate(t: &Thresholds, s: &PoolSignals, tuning: &StabilityTuning) -> RawEvaluation {
    let readings = [
        (
            SignalKind::Pressure,
            s.pressure,
            &t.pressure,
            tuning.hysteresis,
        ),
        (
            SignalKind::QueueDepth,
            s.queue_depth,
            &t.queue_depth,
            tuning.queue_depth_hysteresis,
        ),
        (
            SignalKind::SlaViolationRate,
            s.sla_violation_rate,
            &t.sla_violation_rate,
            tuning.sla_rate_hysteresis,
        ),
    ];
    let mut eval = RawEvaluation {
        escalate: PressureState::Normal,
        escalate_driver: SignalKind::Pressure,
        recover: PressureState::Normal,
        recover_driver: SignalKind::Pressure,
        all_unavailable: true,
    };
    for (kind, value, threshold, band) in readings {
        let Some(v) = value.filter(|v| v.is_finite()) else {
            continue;
        };
        eval.all_unavailable = false;
        let up = threshold.severity(v);
        if up > eval.escalate {
            eval.escalate = up;
            eval.escalate_driver = kind;
        }
        let held = threshold.severity(v + band);
        if held > eval.recover {
            eval.recover = held;
            eval.recover_driver = kind;
        }
    }
    eval
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standard() -> Thresholds {
        Thresholds {
            pressure: Threshold::new(Some(70.0), Some(90.0)),
            queue_depth: Threshold::new(Some(10.0), Some(50.0)),
            sla_violation_rate: Threshold::new(Some(0.2), Some(0.5)),
        }
    }

    fn sig(p: Option<f64>, q: Option<f64>, r: Option<f64>) -> PoolSignals {
        PoolSignals {
            pressure: p,
            queue_depth: q,
            sla_violation_rate: r,
            ..Default::default()
        }
    }

    #[test]
    fn max_severity_over_available_signals() {
        let t = StabilityTuning::default();
        let e = evaluate(&standard(), &sig(Some(20.0), Some(60.0), Some(0.0)), &t);
        assert_eq!(e.escalate, PressureState::Critical);
        assert_eq!(e.escalate_driver, SignalKind::QueueDepth);
        let e = evaluate(&standard(), &sig(None, None, Some(0.3)), &t);
        assert_eq!(e.escalate, PressureState::Elevated);
        assert_eq!(e.escalate_driver, SignalKind::SlaViolationRate);
        assert!(!e.all_unavailable);
    }

    #[test]
    fn all_unavailable_is_flagged_and_nan_counts_as_unavailable() {
        let t = StabilityTuning::default();
        let e = evaluate(&standard(), &sig(None, Some(f64::NAN), None), &t);
        assert!(e.all_unavailable);
        assert_eq!(e.escalate, PressureState::Normal);
    }

    #[test]
    fn hysteresis_band_holds_recovery() {
        let t = StabilityTuning::default();
        let e = evaluate(&standard(), &sig(Some(69.0), None, None), &t);
        assert_eq!(e.escalate, PressureState::Normal);
        assert_eq!(
            e.recover,
            PressureState::Elevated,
            "69 + 5 >= 70 still supports Elevated"
        );
        let e = evaluate(&standard(), &sig(Some(64.0), None, None), &t);
        assert_eq!(e.recover, PressureState::Normal);
    }

    #[test]
    fn disabled_step_never_fires() {
        let best_effort = Thresholds {
            pressure: Threshold::new(None, Some(60.0)),
            ..Default::default()
        };
        let t = StabilityTuning::default();
        assert_eq!(
            evaluate(&best_effort, &sig(Some(59.0), None, None), &t).escalate,
            PressureState::Normal
        );
        assert_eq!(
            evaluate(&best_effort, &sig(Some(60.0), None, None), &t).escalate,
            PressureState::Critical
        );
    }
}
