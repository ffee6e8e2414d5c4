//! A pool's *predicted* work ceiling (adaptive mode): the work in flight past which the tiers
//! it serves would run out of budget, read from how the pool has behaved, before they do.
//!
//! The learned work limit ([`super::work_gate::WorkLimit`]) only moves after a protected tier
//! has run short, seconds after the load that did it; by then the lower tiers' long answers
//! hold the cache and slow every decode step until they end. What the pool's own signals say
//! at once is how full it is and how fast it decodes, and vLLM's decode step is bound by
//! memory bandwidth: each step reads the weights and every running sequence's KV, so its time
//! grows about linearly with the KV in use. So each pool fits `pace = a + b × usage` over its
//! samples (least squares, forgetting slowly) and predicts the usage at which the pace reaches
//! the point where the tightest TPOT budget of the tiers it protects turns short (where the
//! controller would start shedding for it); the ceiling is Sluice's work in flight scaled to
//! that usage.
//!
//! The ceiling caps the work limit the gate applies while the admission level is up; it never
//! refuses anyone on an idle pool (the gate is off at level 0). A pool whose pace does not
//! reach the limit within its cache has no ceiling: a full cache alone is not gated for, since
//! holding lower tiers under it was measured to cost them far more than it bought Guaranteed
//! (one shared backend with KV reserved for `max_tokens`: Standard 19 → 32 % late, Guaranteed
//! unchanged).

/// How slowly old samples are forgotten, ms (a pool's decode speed changes with its model or
/// hardware, not from minute to minute).
const HALF_LIFE_MS: f64 = 300_000.0;
/// The fit is trusted once the usages it saw spread at least this far (standard deviation, as a
/// share of the cache) and weigh this many samples: a pace measured at one usage says nothing of
/// its slope.
const MIN_USAGE_SD: f64 = 0.08;
const MIN_WEIGHT: f64 = 20.0;
/// Usage below which the scale from usage to Sluice's work is too coarse to extrapolate from.
const MIN_USAGE: f64 = 0.05;
/// A pace growing by less than this share over the whole cache is a flat pace read noisily.
const MIN_GROWTH: f64 = 0.05;

/// Exponentially weighted sums for a least-squares line of pace on usage.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PaceFit {
    w: f64,
    u: f64,
    p: f64,
    uu: f64,
    up: f64,
}

impl PaceFit {
    /// One sample: cache usage as a share (0–1) and vLLM's mean pace over the interval (ms),
    /// `dt_ms` after the previous one.
    pub fn sample(&mut self, usage: Option<f64>, pace_ms: Option<f64>, dt_ms: f64) {
        let (Some(u), Some(p)) = (usage, pace_ms) else {
            return;
        };
        if !(u.is_finite() && p.is_finite() && p > 0.0) {
            return;
        }
        let u = u.clamp(0.0, 1.0);
        let keep = 0.5f64.powf(dt_ms.max(0.0) / HALF_LIFE_MS);
        self.w = self.w * keep + 1.0;
        self.u = self.u * keep + u;
        self.p = self.p * keep + p;
        self.uu = self.uu * keep + u * u;
        self.up = self.up * keep + u * p;
    }

    /// `(a, b)` of `pace = a + b × usage`, once the samples spread enough to say; `b` is
    /// positive (a pace that does not grow with the cache has no pace ceiling).
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.w < MIN_WEIGHT {
            return None;
        }
        let mu = self.u / self.w;
        let mp = self.p / self.w;
        let var = self.uu / self.w - mu * mu;
        if var < MIN_USAGE_SD * MIN_USAGE_SD {
            return None;
        }
        let b = (self.up / self.w - mu * mp) / var;
        let a = mp - b * mu;
        (b > MIN_GROWTH * a.abs().max(f64::EPSILON)).then_some((a, b))
    }

    /// The usage (0–1) at which the pace would reach `pace_ms`; `None` past a full cache.
    pub fn usage_at(&self, pace_ms: f64) -> Option<f64> {
        let (a, b) = self.line()?;
        Some(((pace_ms - a) / b).max(0.0)).filter(|u| *u < 1.0)
    }
}

/// The work in flight at which the pool would reach `usage_limit` (0–1), scaled from the work
/// in flight now and the usage it fills: `None` while too little is in use to scale from.
pub fn work_at(usage_limit: f64, usage_now: f64, inflight: f64) -> Option<f64> {
    (usage_now >= MIN_USAGE && inflight > 0.0 && usage_limit.is_finite())
        .then(|| inflight * usage_limit / usage_now)
}

/// The pool's predicted ceiling in work: where the pace would reach `pace_limit_ms` (the
/// tightest protected TPOT budget's shortage point on the pool).
pub fn ceiling(
    fit: &PaceFit,
    pace_limit_ms: Option<f64>,
    usage_now: Option<f64>,
    inflight: Option<f64>,
) -> Option<f64> {
    let limit = fit.usage_at(pace_limit_ms?)?;
    work_at(limit, usage_now?, inflight?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_growing_with_the_cache_is_fitted_and_inverted() {
        let mut fit = PaceFit::default();
        for i in 0..40 {
            let u = (i % 10) as f64 / 10.0;
            fit.sample(Some(u), Some(20.0 * (1.0 + 1.5 * u)), 250.0);
        }
        let (a, b) = fit.line().unwrap();
        assert!(
            (a - 20.0).abs() < 1e-6 && (b - 30.0).abs() < 1e-6,
            "{a} {b}"
        );
        // 1.42x the unloaded pace is reached at 28 % of the cache.
        assert!((fit.usage_at(28.4).unwrap() - 0.28).abs() < 1e-6);
    }

    #[test]
    fn a_fixed_pace_or_one_usage_gives_no_pace_ceiling() {
        let mut flat = PaceFit::default();
        let mut narrow = PaceFit::default();
        for i in 0..40 {
            flat.sample(Some((i % 10) as f64 / 10.0), Some(10.0), 250.0);
            narrow.sample(Some(0.5), Some(10.0 + i as f64), 250.0);
        }
        assert_eq!(flat.line(), None);
        assert_eq!(narrow.line(), None);
        assert_eq!(ceiling(&flat, Some(12.0), Some(0.4), Some(1000.0)), None);
        // A pace that wobbles by a hair with the cache is still flat.
        let mut wobble = PaceFit::default();
        for i in 0..40 {
            let u = (i % 10) as f64 / 10.0;
            wobble.sample(Some(u), Some(10.0 + 0.2 * u), 250.0);
        }
        assert_eq!(wobble.line(), None);
    }

    #[test]
    fn the_ceiling_scales_the_work_to_the_usage_the_pace_allows() {
        let mut fit = PaceFit::default();
        for i in 0..40 {
            let u = (i % 10) as f64 / 10.0;
            fit.sample(Some(u), Some(20.0 + 30.0 * u), 250.0);
        }
        // 2,000 tokens in flight fill 50 %; the pace reaches 26 ms at 20 %: 800 tokens.
        let c = ceiling(&fit, Some(26.0), Some(0.5), Some(2000.0)).unwrap();
        assert!((c - 800.0).abs() < 1e-6, "{c}");
        // A pace limit the full cache does not reach: no ceiling.
        assert_eq!(ceiling(&fit, Some(200.0), Some(0.5), Some(2000.0)), None);
        // Too little in use to scale from: no ceiling.
        assert_eq!(ceiling(&fit, Some(26.0), Some(0.01), Some(10.0)), None);
    }
}
