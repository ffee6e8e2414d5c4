//! Stage 2, stability: turns raw severities into a state that does not flap. A transition needs
//! `consecutive_samples` agreeing samples, at least `cooldown_ms` since the previous transition,
//! and moving down needs every signal below its threshold minus the hysteresis band.

use crate::pressure::RawEvaluation;
pub use crate::tuning::StabilityTuning;
use crate::types::{Millis, PressureState, SignalKind};

#[derive(Debug, Clone)]
pub struct StabilityModel {
    tuning: StabilityTuning,
    state: PressureState,
    driver: SignalKind,
    pending: Option<(PressureState, u32)>,
    last_change: Option<Millis>,
}

impl StabilityModel {
    pub fn new(tuning: StabilityTuning) -> Self {
        Self {
            tuning,
            state: PressureState::Normal,
            driver: SignalKind::Pressure,
            pending: None,
            last_change: None,
        }
    }

    pub fn set_tuning(&mut self, tuning: StabilityTuning) {
        self.tuning = tuning;
    }

    pub fn state(&self) -> PressureState {
        self.state
    }

    pub fn driver(&self) -> SignalKind {
        self.driver
    }

    pub fn observe(&mut self, raw: &RawEvaluation, now: Millis) -> PressureState {
        if raw.all_unavailable {
            // Failing open: forget the old state so stale severity cannot outlive its evidence.
            self.state = PressureState::Normal;
            self.pending = None;
            return self.state;
        }
        let (candidate, driver) = if raw.escalate > self.state {
            (raw.escalate, raw.escalate_driver)
        } else if raw.recover < self.state {
            (raw.recover, raw.recover_driver)
        } else {
            self.pending = None;
            return self.state;
        };
        let count = match self.pending {
            Some((target, n)) if target == candidate => n + 1,
            _ => 1,
        };
        self.pending = Some((candidate, count));
        let cooled = self
            .last_change
            .is_none_or(|t| now.saturating_sub(t) >= self.tuning.cooldown_ms);
        if count >= self.tuning.consecutive_samples.max(1) && cooled {
            self.state = candidate;
            self.driver = driver;
            self.last_change = Some(now);
            self.pending = None;
        }
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::super::pressure::{evaluate, Threshold, Thresholds};
    use super::super::PoolSignals;
    use super::*;
    use PressureState::*;

    fn standard() -> Thresholds {
        Thresholds {
            pressure: Threshold::new(Some(70.0), Some(90.0)),
            ..Default::default()
        }
    }

    fn step(m: &mut StabilityModel, pressure: f64, t_secs: u64) -> PressureState {
        let s = PoolSignals {
            pressure: Some(pressure),
            ..Default::default()
        };
        let raw = evaluate(&standard(), &s, &StabilityTuning::default());
        m.observe(&raw, t_secs * 1000)
    }

    /// The seed's trace (tests/test_fallback_queue.py) must hold exactly.
    #[test]
    fn seed_trace() {
        let mut m = StabilityModel::new(StabilityTuning::default());
        assert_eq!(
            step(&mut m, 75.0, 1),
            Normal,
            "first sample waits for confirmation"
        );
        assert_eq!(step(&mut m, 75.0, 2), Elevated, "confirmed");
        assert_eq!(
            step(&mut m, 69.0, 3),
            Elevated,
            "inside the hysteresis band"
        );
        assert_eq!(step(&mut m, 64.0, 4), Elevated, "waiting for confirmation");
        assert_eq!(step(&mut m, 64.0, 5), Normal, "confirmed");
    }

    #[test]
    fn cooldown_delays_a_confirmed_transition() {
        let mut m = StabilityModel::new(StabilityTuning::default());
        step(&mut m, 75.0, 1);
        assert_eq!(step(&mut m, 75.0, 2), Elevated);
        // Critical is confirmed at t=3 but the cooldown (2 s since t=2) holds it until t=4.
        assert_eq!(step(&mut m, 95.0, 2), Elevated);
        assert_eq!(step(&mut m, 95.0, 3), Elevated);
        assert_eq!(step(&mut m, 95.0, 4), Critical);
    }

    #[test]
    fn oscillation_at_threshold_does_not_flap() {
        let mut m = StabilityModel::new(StabilityTuning::default());
        let mut changes = 0;
        let mut last = Normal;
        for t in 0..40 {
            let p = if t % 2 == 0 { 71.0 } else { 68.0 };
            let s = step(&mut m, p, t);
            if s != last {
                changes += 1;
                last = s;
            }
        }
        assert_eq!(changes, 0, "alternating samples never confirm a transition");
    }

    #[test]
    fn all_unavailable_resets_to_normal() {
        let mut m = StabilityModel::new(StabilityTuning::default());
        step(&mut m, 95.0, 1);
        assert_eq!(step(&mut m, 95.0, 2), Critical);
        let raw = evaluate(
            &standard(),
            &PoolSignals::default(),
            &StabilityTuning::default(),
        );
        assert_eq!(m.observe(&raw, 3000), Normal);
    }
}
