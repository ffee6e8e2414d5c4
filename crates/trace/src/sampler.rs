//! The head sampling decision for a request's trace, with OpenTelemetry's built-in samplers and
//! their `OTEL_TRACES_SAMPLER` names.
//!
//! - `traceidratio` is the spec's `TraceIdRatioBased`: the trace id's least significant 56 bits
//!   (its W3C Level 2 randomness) `R` are compared with the rejection threshold
//!   `T = (1 - ratio) * 2^56`, sampled when `R >= T`: deterministic on the id, so every service
//!   with the same ratio agrees, and a trace sampled at a ratio is sampled at every higher one.
//!   It ignores the parent's flag. (The tracestate `ot=th:`/`rv:` fields are neither read nor
//!   written.)
//! - `parentbased_*` follows the caller's sampled flag when there is a caller and uses the named
//!   sampler only for a trace Sluice starts. `parentbased_traceidratio` is Sluice's default.
//!
//! The decision is taken once, for the SERVER span; a request's CLIENT spans inherit it.

use crate::context::{SpanContext, TraceId};
use serde::Deserialize;
use std::fmt;

/// The sampler names of `OTEL_TRACES_SAMPLER` (and `telemetry.tracing.sampler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerKind {
    AlwaysOn,
    AlwaysOff,
    #[serde(rename = "traceidratio")]
    TraceIdRatio,
    ParentbasedAlwaysOn,
    ParentbasedAlwaysOff,
    #[default]
    #[serde(rename = "parentbased_traceidratio")]
    ParentbasedTraceIdRatio,
}

impl SamplerKind {
    pub const ALL: [SamplerKind; 6] = [
        Self::AlwaysOn,
        Self::AlwaysOff,
        Self::TraceIdRatio,
        Self::ParentbasedAlwaysOn,
        Self::ParentbasedAlwaysOff,
        Self::ParentbasedTraceIdRatio,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlwaysOn => "always_on",
            Self::AlwaysOff => "always_off",
            Self::TraceIdRatio => "traceidratio",
            Self::ParentbasedAlwaysOn => "parentbased_always_on",
            Self::ParentbasedAlwaysOff => "parentbased_always_off",
            Self::ParentbasedTraceIdRatio => "parentbased_traceidratio",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(name))
    }

    /// Whether the ratio (`OTEL_TRACES_SAMPLER_ARG`) applies.
    pub fn uses_ratio(self) -> bool {
        matches!(self, Self::TraceIdRatio | Self::ParentbasedTraceIdRatio)
    }

    fn parent_based(self) -> bool {
        matches!(
            self,
            Self::ParentbasedAlwaysOn | Self::ParentbasedAlwaysOff | Self::ParentbasedTraceIdRatio
        )
    }
}

impl fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// 2^56: the randomness range.
const RANGE: u64 = 1 << 56;

/// A sampler, its threshold computed once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    kind: SamplerKind,
    ratio: f64,
    /// Sampled when the trace's randomness is at least this; `RANGE` samples nothing.
    threshold: u64,
}

impl Sampler {
    /// `ratio` is clamped to [0, 1] (NaN counts as 0) and ignored by the samplers that take none.
    pub fn new(kind: SamplerKind, ratio: f64) -> Self {
        let ratio = if ratio.is_nan() {
            0.0
        } else {
            ratio.clamp(0.0, 1.0)
        };
        let threshold = match kind {
            SamplerKind::AlwaysOn | SamplerKind::ParentbasedAlwaysOn => 0,
            SamplerKind::AlwaysOff | SamplerKind::ParentbasedAlwaysOff => RANGE,
            // Rounded to the nearest threshold, as the spec's 56-bit encoding does.
            _ => ((1.0 - ratio) * RANGE as f64).round() as u64,
        }
        .min(RANGE);
        Self {
            kind,
            ratio,
            threshold,
        }
    }

    pub fn kind(&self) -> SamplerKind {
        self.kind
    }

    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// Whether the trace `trace_id` (the caller's, or a new one when `parent` is `None`) is
    /// recorded here.
    pub fn should_sample(&self, parent: Option<&SpanContext>, trace_id: TraceId) -> bool {
        if self.kind.parent_based() {
            if let Some(p) = parent {
                return p.is_sampled();
            }
        }
        trace_id.randomness() >= self.threshold
    }
}

impl fmt::Display for Sampler {
    /// The spec's description form, e.g. `ParentBased{root=TraceIdRatioBased{0.1}}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let root = match self.kind {
            SamplerKind::AlwaysOn | SamplerKind::ParentbasedAlwaysOn => "AlwaysOnSampler".into(),
            SamplerKind::AlwaysOff | SamplerKind::ParentbasedAlwaysOff => "AlwaysOffSampler".into(),
            _ => format!("TraceIdRatioBased{{{}}}", self.ratio),
        };
        if self.kind.parent_based() {
            write!(f, "ParentBased{{root={root}}}")
        } else {
            f.write_str(&root)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{SpanId, TraceFlags};
    use crate::ids::new_trace_id;

    fn parent(sampled: bool) -> SpanContext {
        SpanContext {
            trace_id: new_trace_id(),
            span_id: SpanId([1; 8]),
            flags: TraceFlags(0).with_sampled(sampled),
            is_remote: true,
        }
    }

    fn id_with_randomness(r: u64) -> TraceId {
        let mut id = [0xab; 16];
        id[8..].copy_from_slice(&r.to_be_bytes());
        id[8] = 0xab;
        TraceId(id)
    }

    #[test]
    fn names_parse_like_the_environment_variable() {
        for k in SamplerKind::ALL {
            assert_eq!(SamplerKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(
            SamplerKind::parse(" ParentBased_TraceIdRatio "),
            Some(SamplerKind::ParentbasedTraceIdRatio)
        );
        assert_eq!(SamplerKind::parse("jaeger_remote"), None);
        assert_eq!(SamplerKind::default(), SamplerKind::ParentbasedTraceIdRatio);
    }

    #[test]
    fn always_on_and_off_ignore_the_id() {
        let on = Sampler::new(SamplerKind::AlwaysOn, 0.0);
        let off = Sampler::new(SamplerKind::AlwaysOff, 1.0);
        for r in [0, 1, RANGE - 1] {
            assert!(on.should_sample(None, id_with_randomness(r)));
            assert!(!off.should_sample(None, id_with_randomness(r)));
        }
        assert!(on.should_sample(Some(&parent(false)), new_trace_id()));
        assert!(!off.should_sample(Some(&parent(true)), new_trace_id()));
    }

    #[test]
    fn ratio_zero_samples_nothing_and_one_everything() {
        let none = Sampler::new(SamplerKind::TraceIdRatio, 0.0);
        let all = Sampler::new(SamplerKind::TraceIdRatio, 1.0);
        for r in [0, 1, RANGE / 2, RANGE - 1] {
            assert!(!none.should_sample(None, id_with_randomness(r)), "{r}");
            assert!(all.should_sample(None, id_with_randomness(r)), "{r}");
        }
        assert_eq!(Sampler::new(SamplerKind::TraceIdRatio, 7.0).ratio(), 1.0);
        assert_eq!(
            Sampler::new(SamplerKind::TraceIdRatio, f64::NAN).ratio(),
            0.0
        );
    }

    #[test]
    fn ratio_compares_the_low_56_bits_with_the_rejection_threshold() {
        let half = Sampler::new(SamplerKind::TraceIdRatio, 0.5);
        assert!(!half.should_sample(None, id_with_randomness(RANGE / 2 - 1)));
        assert!(half.should_sample(None, id_with_randomness(RANGE / 2)));
        // The top byte is not randomness: it does not count.
        let mut id = id_with_randomness(0);
        id.0[8] = 0xff;
        assert!(!half.should_sample(None, id));
    }

    #[test]
    fn ratio_is_deterministic_nested_and_close_to_its_rate() {
        let quarter = Sampler::new(SamplerKind::TraceIdRatio, 0.25);
        let half = Sampler::new(SamplerKind::TraceIdRatio, 0.5);
        let ids: Vec<TraceId> = (0..40_000).map(|_| new_trace_id()).collect();
        let mut sampled = 0;
        for id in &ids {
            let q = quarter.should_sample(None, *id);
            assert_eq!(q, quarter.should_sample(None, *id), "deterministic");
            assert!(
                !q || half.should_sample(None, *id),
                "a higher ratio keeps it"
            );
            sampled += usize::from(q);
        }
        assert!((9_200..10_800).contains(&sampled), "{sampled} of 40000");
        // The ratio sampler ignores the parent's flag.
        let id = ids
            .iter()
            .find(|id| quarter.should_sample(None, **id))
            .unwrap();
        assert!(quarter.should_sample(Some(&parent(false)), *id));
    }

    #[test]
    fn parent_based_follows_the_parent_and_uses_the_root_sampler_otherwise() {
        let pb_ratio0 = Sampler::new(SamplerKind::ParentbasedTraceIdRatio, 0.0);
        let pb_ratio1 = Sampler::new(SamplerKind::ParentbasedTraceIdRatio, 1.0);
        let pb_off = Sampler::new(SamplerKind::ParentbasedAlwaysOff, 1.0);
        let pb_on = Sampler::new(SamplerKind::ParentbasedAlwaysOn, 0.0);
        let id = new_trace_id();
        assert!(pb_ratio0.should_sample(Some(&parent(true)), id));
        assert!(!pb_ratio1.should_sample(Some(&parent(false)), id));
        assert!(!pb_ratio0.should_sample(None, id));
        assert!(pb_ratio1.should_sample(None, id));
        assert!(pb_off.should_sample(Some(&parent(true)), id));
        assert!(!pb_off.should_sample(None, id));
        assert!(!pb_on.should_sample(Some(&parent(false)), id));
        assert!(pb_on.should_sample(None, id));
    }

    #[test]
    fn descriptions_follow_the_spec() {
        let s = Sampler::new(SamplerKind::ParentbasedTraceIdRatio, 0.1);
        assert_eq!(s.to_string(), "ParentBased{root=TraceIdRatioBased{0.1}}");
        assert_eq!(
            Sampler::new(SamplerKind::AlwaysOff, 0.0).to_string(),
            "AlwaysOffSampler"
        );
    }
}
