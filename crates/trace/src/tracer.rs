//! The tracer the proxy holds: it decides sampling once per request, mints ids, starts the
//! SERVER and CLIENT spans and hands finished ones to the export queue.

use crate::config::{TracingConfig, TracingConfigError};
use crate::context::{Propagated, SpanContext, TraceFlags};
use crate::export::{channel, ExportSettings, ExportStats, Exporter, SpanSink};
use crate::ids::{new_span_id, new_trace_id};
use crate::sampler::Sampler;
use crate::span::{SpanBuilder, SpanKind, Str};
use serde::Serialize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Attribute room reserved for a SERVER span (Sluice sets about 26: growing the encoding
/// copies it).
const SERVER_ATTRIBUTES: usize = 32;
/// And for a CLIENT span (about 14).
const CLIENT_ATTRIBUTES: usize = 16;

/// Starts and ends spans. Cheap to clone; shared by every worker thread.
#[derive(Debug, Clone)]
pub struct Tracer {
    sampler: Sampler,
    sink: Option<SpanSink>,
    stats: Arc<ExportStats>,
    /// Where spans are posted (`None` when tracing is off), for `/status`.
    endpoint: Option<Arc<str>>,
}

/// What `/status` shows of tracing: the settings in force and the exporter's counters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TracingStatus {
    pub enabled: bool,
    /// The URL spans are posted to.
    pub endpoint: Option<Arc<str>>,
    /// The `OTEL_TRACES_SAMPLER` name, and the ratio when the sampler uses one.
    pub sampler: Option<&'static str>,
    pub ratio: Option<f64>,
    /// Finished spans waiting for export now.
    pub queued: usize,
    pub spans_exported: u64,
    /// Dropped at the door: the queue was full.
    pub spans_dropped: u64,
    /// Lost with a batch the collector refused or did not answer in time.
    pub spans_failed: u64,
    pub batches_exported: u64,
    pub batches_failed: u64,
    pub consecutive_failures: u64,
    pub last_error: Option<String>,
    /// Unix milliseconds of the last failure.
    pub last_error_at_ms: Option<u64>,
}

impl Tracer {
    /// Tracing off: nothing records, and [`Self::start_server`] / [`Self::start_client`] hand
    /// the caller's context through unchanged.
    pub fn disabled() -> Self {
        Self {
            sampler: Sampler::new(crate::SamplerKind::AlwaysOff, 0.0),
            sink: None,
            stats: Arc::default(),
            endpoint: None,
        }
    }

    /// The tracer `cfg` asks for, and the exporter task to run (`None` when tracing is off).
    /// `cfg` should already carry the environment ([`TracingConfig::apply_env`]).
    pub fn from_config(
        cfg: &TracingConfig,
    ) -> Result<(Tracer, Option<Exporter>), TracingConfigError> {
        cfg.validate()?;
        if !cfg.enabled {
            return Ok((Self::disabled(), None));
        }
        let (sink, exporter) = channel(ExportSettings::from_config(cfg)?);
        let sampler = Sampler::new(cfg.sampler, cfg.ratio);
        let mut tracer = Self::with_sink(sampler, sink);
        tracer.endpoint = Some(cfg.traces_url().into());
        Ok((tracer, Some(exporter)))
    }

    /// A tracer over an existing queue (tests, benchmarks).
    pub fn with_sink(sampler: Sampler, sink: SpanSink) -> Self {
        Self {
            sampler,
            stats: sink.stats().clone(),
            sink: Some(sink),
            endpoint: None,
        }
    }

    /// The settings in force and the exporter's counters, for `/status`.
    pub fn status(&self) -> TracingStatus {
        let s = &self.stats;
        let enabled = self.is_enabled();
        let kind = self.sampler.kind();
        let at = s.last_error_at_ms.load(Relaxed);
        TracingStatus {
            enabled,
            endpoint: self.endpoint.clone(),
            sampler: enabled.then(|| kind.as_str()),
            ratio: (enabled && kind.uses_ratio()).then(|| self.sampler.ratio()),
            queued: self.queued(),
            spans_exported: s.spans_exported.load(Relaxed),
            spans_dropped: s.spans_dropped.load(Relaxed),
            spans_failed: s.spans_failed.load(Relaxed),
            batches_exported: s.batches_exported.load(Relaxed),
            batches_failed: s.batches_failed.load(Relaxed),
            consecutive_failures: s.consecutive_failures.load(Relaxed),
            last_error: s.last_error(),
            last_error_at_ms: (at > 0).then_some(at),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.sink.is_some()
    }

    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The exporter's counters (all zero when disabled).
    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    /// Spans waiting for export.
    pub fn queued(&self) -> usize {
        self.sink.as_ref().map_or(0, SpanSink::queued)
    }

    /// The SERVER span of a request: continues the caller's trace when it sent a valid
    /// `traceparent` (else starts one, with the random flag), takes the sampling decision, and
    /// has a new span id either way, so the backend's spans hang under Sluice's.
    pub fn start_server(
        &self,
        incoming: Option<&Propagated>,
        name: impl Into<Str>,
        start_unix_nanos: u64,
    ) -> SpanBuilder {
        let parent = incoming.map(|p| &p.parent);
        let state = incoming.and_then(|p| p.state.clone());
        if !self.is_enabled() {
            let context = parent.copied().unwrap_or(SpanContext {
                trace_id: new_trace_id(),
                span_id: new_span_id(),
                flags: TraceFlags(TraceFlags::RANDOM),
                is_remote: false,
            });
            return SpanBuilder::non_recording(context, state);
        }
        let trace_id = parent.map_or_else(new_trace_id, |p| p.trace_id);
        let sampled = self.sampler.should_sample(parent, trace_id);
        let flags = parent
            .map_or(TraceFlags(TraceFlags::RANDOM), |p| p.flags)
            .with_sampled(sampled);
        let context = SpanContext {
            trace_id,
            span_id: new_span_id(),
            flags,
            is_remote: false,
        };
        if !sampled {
            return SpanBuilder::non_recording(context, state);
        }
        SpanBuilder::recording(
            context,
            state,
            parent.map(|p| (p.span_id, true)),
            name.into(),
            SpanKind::Server,
            start_unix_nanos,
            SERVER_ATTRIBUTES,
        )
    }

    /// A CLIENT span for one upstream attempt, child of `parent` (the SERVER span), sampled as
    /// it is. Its [`SpanBuilder::traceparent`] is what the backend is sent.
    pub fn start_client(
        &self,
        parent: &SpanBuilder,
        name: impl Into<Str>,
        start_unix_nanos: u64,
    ) -> SpanBuilder {
        let state = parent.trace_state().cloned();
        if !self.is_enabled() {
            return SpanBuilder::non_recording(*parent.context(), state);
        }
        let p = parent.context();
        let context = SpanContext {
            trace_id: p.trace_id,
            span_id: new_span_id(),
            flags: p.flags,
            is_remote: false,
        };
        if !parent.is_recording() {
            return SpanBuilder::non_recording(context, state);
        }
        SpanBuilder::recording(
            context,
            state,
            Some((p.span_id, false)),
            name.into(),
            SpanKind::Client,
            start_unix_nanos,
            CLIENT_ATTRIBUTES,
        )
    }

    /// Ends `span` at `end_unix_nanos` and queues it for export if it recorded; never waits.
    pub fn end(&self, span: SpanBuilder, end_unix_nanos: u64) {
        if let (Some(record), Some(sink)) = (span.finish(end_unix_nanos), &self.sink) {
            sink.submit(record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::extract;
    use crate::SamplerKind;

    const PARENT: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn tracer(kind: SamplerKind, ratio: f64) -> (Tracer, Exporter) {
        let cfg = TracingConfig {
            enabled: true,
            sampler: kind,
            ratio,
            ..Default::default()
        };
        let (t, e) = Tracer::from_config(&cfg).unwrap();
        (t, e.unwrap())
    }

    #[test]
    fn a_server_span_continues_the_callers_trace() {
        let (t, _e) = tracer(SamplerKind::ParentbasedTraceIdRatio, 0.0);
        let incoming = extract(Some(PARENT), [b"congo=t61".as_slice()]).unwrap();
        let server = t.start_server(Some(&incoming), "chat m", 1);
        assert!(
            server.is_recording(),
            "the sampled parent wins over ratio 0"
        );
        let c = server.context();
        assert_eq!(c.trace_id, incoming.parent.trace_id);
        assert_ne!(c.span_id, incoming.parent.span_id);
        let s = server.span().unwrap();
        assert_eq!(s.parent_span_id, Some(incoming.parent.span_id));
        assert!(s.parent_is_remote);
        assert_eq!(s.kind, SpanKind::Server);

        let client = t.start_client(&server, "chat m", 2);
        let cs = client.span().unwrap();
        assert_eq!(cs.parent_span_id, Some(c.span_id));
        assert!(!cs.parent_is_remote);
        assert_eq!(cs.kind, SpanKind::Client);
        assert_eq!(client.trace_state().unwrap().as_str(), "congo=t61");
        let tp = client.traceparent();
        assert!(tp
            .as_str()
            .starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(tp.as_str().ends_with("-01"));
        assert_eq!(&tp.as_str()[36..52], client.context().span_id.to_string());
        t.end(client, 3);
        t.end(server, 4);
        assert_eq!(t.queued(), 2);
    }

    #[test]
    fn an_unsampled_trace_records_nothing_but_still_propagates() {
        let (t, _e) = tracer(SamplerKind::ParentbasedTraceIdRatio, 1.0);
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let incoming = extract(Some(unsampled), []).unwrap();
        let server = t.start_server(Some(&incoming), "chat m", 1);
        assert!(!server.is_recording());
        let client = t.start_client(&server, "chat m", 2);
        assert!(!client.is_recording());
        assert!(client.traceparent().as_str().ends_with("-00"));
        assert_eq!(client.context().trace_id, incoming.parent.trace_id);
        t.end(client, 3);
        t.end(server, 4);
        assert_eq!(t.queued(), 0);
    }

    #[test]
    fn a_new_root_is_random_flagged_and_follows_the_ratio() {
        let (t, _e) = tracer(SamplerKind::ParentbasedTraceIdRatio, 1.0);
        let s = t.start_server(None, "chat m", 1);
        assert!(s.is_recording());
        assert_eq!(s.context().flags, TraceFlags(0x03));
        assert_eq!(s.span().unwrap().parent_span_id, None);
        let (off, _e) = tracer(SamplerKind::ParentbasedTraceIdRatio, 0.0);
        let s = off.start_server(None, "chat m", 1);
        assert!(!s.is_recording());
        assert!(s.traceparent().as_str().ends_with("-02"));
    }

    #[test]
    fn a_disabled_tracer_hands_the_callers_context_through() {
        let t = Tracer::disabled();
        let incoming = extract(Some(PARENT), []).unwrap();
        let server = t.start_server(Some(&incoming), "x", 1);
        let client = t.start_client(&server, "x", 1);
        assert!(!client.is_recording());
        assert_eq!(client.traceparent().as_bytes(), PARENT);
        let (t, e) = Tracer::from_config(&TracingConfig::default()).unwrap();
        assert!(!t.is_enabled() && e.is_none());
        let st = t.status();
        assert!(!st.enabled && st.endpoint.is_none() && st.sampler.is_none());
    }

    #[test]
    fn status_names_the_endpoint_and_the_sampler_and_counts() {
        let cfg = TracingConfig {
            enabled: true,
            endpoint: Some("http://collector:4318".into()),
            ratio: 0.25,
            ..Default::default()
        };
        let (t, _e) = Tracer::from_config(&cfg).unwrap();
        let s = t.start_server(None, "chat m", 1);
        t.end(s, 2);
        let st = t.status();
        assert_eq!(
            st.endpoint.as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(
            (st.sampler, st.ratio),
            (Some("parentbased_traceidratio"), Some(0.25))
        );
        assert!(st.queued <= 1 && st.last_error.is_none() && st.last_error_at_ms.is_none());
        let (always, _e2) = tracer(SamplerKind::ParentbasedAlwaysOn, 1.0);
        assert_eq!(
            always.status().ratio,
            None,
            "a sampler without a ratio shows none"
        );
    }
}
