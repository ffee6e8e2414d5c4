//! Sluice's distributed tracing, everything but the Pingora glue: when a Guaranteed answer is
//! slow, its trace shows where the time went — Sluice's queue and decision (the SERVER span),
//! each upstream attempt (a CLIENT span), and under it vLLM's own `llm_request` span (vLLM
//! continues the `traceparent` Sluice sends when run with `--otlp-traces-endpoint`).
//!
//! One request, in the order the proxy's phases meet it:
//!
//! ```
//! use sluice_trace::{extract, now_unix_nanos, semconv as sc, Tracer, TracingConfig};
//!
//! let mut cfg = TracingConfig { enabled: true, ..Default::default() };
//! let _warnings = cfg.apply_env(&|_| None).unwrap();          // OTEL_* over the file
//! let (tracer, _exporter) = Tracer::from_config(&cfg).unwrap(); // spawn _exporter.run(shutdown)
//!
//! // request_filter: continue the caller's trace (or start one) and decide sampling once.
//! let incoming = extract(
//!     Some(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".as_slice()),
//!     [b"congo=t61rcWkgMzE".as_slice()],
//! );
//! let mut server = tracer.start_server(incoming.as_ref(), "chat llama-3-70b", now_unix_nanos());
//! server.set(sc::SLUICE_TIER, "Guaranteed");
//! server.set(sc::SLUICE_DECISION, "pass");
//!
//! // upstream_request_filter: one CLIENT span per attempt, its context sent to vLLM.
//! let mut client = tracer.start_client(&server, "chat llama-3-70b", now_unix_nanos());
//! client.set(sc::SLUICE_ATTEMPT, 1u32);
//! let traceparent = client.traceparent(); // insert as the `traceparent` header
//! assert_eq!(&traceparent.as_str()[..36], "00-4bf92f3577b34da6a3ce929d0e0e4736-");
//!
//! // logging: end both; export happens on the background task, never here.
//! tracer.end(client, now_unix_nanos());
//! tracer.end(server, now_unix_nanos());
//! ```
//!
//! Modules: [`context`] (W3C `traceparent` / `tracestate`), [`ids`] (fast ids), [`sampler`]
//! (OpenTelemetry's samplers), [`span`] (spans as data, the builder), [`value`] (attribute names
//! and values), [`attributes`] (encoded as they are set), [`semconv`] (attribute names),
//! [`config`] (`telemetry.tracing` and the `OTEL_*` variables), [`otlp`] (the protobuf
//! encoding), [`export`] (the bounded queue and the batching exporter task), [`tracer`].

pub mod attributes;
pub mod config;
pub mod context;
pub mod export;
pub mod ids;
pub mod otlp;
pub mod sampler;
pub mod semconv;
pub mod span;
pub mod tracer;
pub mod value;

pub use config::{TracingConfig, TracingConfigError};
pub use context::{
    extract, parse_traceparent, Propagated, SpanContext, SpanId, TraceFlags, TraceId, TraceState,
    Traceparent, TraceparentError,
};
pub use export::{ExportSettings, ExportStats, Exporter, SpanSink};
pub use sampler::{Sampler, SamplerKind};
pub use span::{
    instant_unix_nanos, now_unix_nanos, unix_nanos, AttrValue, Attributes, Event, Key, Span,
    SpanBuilder, SpanKind, Status, Str, Value,
};
pub use tracer::{Tracer, TracingStatus};
