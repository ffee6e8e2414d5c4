//! The fallback tracker: separate from the tier state machine because rewriting a whole tier to a
//! smaller model is a heavier intervention than a cap and needs more evidence. Pressure must stay
//! at or above `pressure_at` for `sustained_intervals` samples to activate, and below
//! `recover_below` for as many samples to deactivate, with a cooldown between changes.

use crate::types::Millis;

/// Defaults are the seed's: SLUICE_FALLBACK_PRESSURE_AT=85, SLUICE_FALLBACK_RECOVER_BELOW=75,
/// SLUICE_FALLBACK_SUSTAINED_INTERVALS=3, SLUICE_FALLBACK_COOLDOWN_SECONDS=2.
#[derive(Debug, Clone, PartialEq)]
pub struct FallbackTuning {
    pub pressure_at: f64,
    pub recover_below: f64,
    pub sustained_intervals: u32,
    pub cooldown_ms: Millis,
}

impl Default for FallbackTuning {
    fn default() -> Self {
        Self {
            pressure_at: 85.0,
            recover_below: 75.0,
            sustained_intervals: 3,
            cooldown_ms: 2000,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SustainedPressureTracker {
    tuning: FallbackTuning,
    active: bool,
    streak: u32,
    last_change: Option<Millis>,
}

impl SustainedPressureTracker {
    pub fn new(tuning: FallbackTuning) -> Self {
        Self {
            tuning,
            active: false,
            streak: 0,
            last_change: None,
        }
    }

    pub fn set_tuning(&mut self, tuning: FallbackTuning) {
        self.tuning = tuning;
    }

    pub fn active(&self) -> bool {
        self.active
    }

    /// An unavailable sample breaks the streak: "sustained" means sustained *evidence*.
    pub fn observe(&mut self, pressure: Option<f64>, now: Millis) -> bool {
        let Some(p) = pressure.filter(|p| p.is_finite()) else {
            self.streak = 0;
            return self.active;
        };
        let toward_change = if self.active {
            p < self.tuning.recover_below
        } else {
            p >= self.tuning.pressure_at
        };
        self.streak = if toward_change { self.streak + 1 } else { 0 };
        let cooled = self
            .last_change
            .is_none_or(|t| now.saturating_sub(t) >= self.tuning.cooldown_ms);
        if self.streak >= self.tuning.sustained_intervals.max(1) && cooled {
            self.active = !self.active;
            self.streak = 0;
            self.last_change = Some(now);
        }
        self.active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activates_after_three_sustained_samples_and_recovers_after_three_low() {
        let mut t = SustainedPressureTracker::new(FallbackTuning::default());
        assert!(!t.observe(Some(90.0), 1000));
        assert!(!t.observe(Some(90.0), 2000));
        assert!(
            t.observe(Some(90.0), 3000),
            "third interval at >= 85 activates"
        );
        assert!(t.observe(Some(80.0), 4000), "between 75 and 85 holds");
        assert!(t.observe(Some(70.0), 5000));
        assert!(t.observe(Some(70.0), 6000));
        assert!(
            !t.observe(Some(70.0), 7000),
            "third interval below 75 recovers"
        );
    }

    #[test]
    fn a_spike_does_not_activate() {
        let mut t = SustainedPressureTracker::new(FallbackTuning::default());
        for (i, p) in [99.0, 99.0, 50.0, 99.0, 99.0, 50.0].into_iter().enumerate() {
            assert!(!t.observe(Some(p), i as u64 * 1000));
        }
    }

    #[test]
    fn unavailable_breaks_the_streak() {
        let mut t = SustainedPressureTracker::new(FallbackTuning::default());
        t.observe(Some(90.0), 1000);
        t.observe(Some(90.0), 2000);
        assert!(!t.observe(None, 3000));
        assert!(!t.observe(Some(90.0), 4000));
    }
}
