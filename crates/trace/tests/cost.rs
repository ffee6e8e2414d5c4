//! What tracing costs the request path, as the proxy spends it (`crates/proxy/src/spans.rs`): a
//! sampled request's SERVER and CLIENT spans with their attributes, the `traceparent` formatted,
//! the trace id as text for the record, both spans queued; an unsampled request's context only.
//! A measurement, not a check: run it in release,
//! `cargo test --release -p sluice-trace --test cost -- --ignored --nocapture`.

use sluice_trace::otlp::{encode_request, encode_resource, Scope};
use sluice_trace::semconv as sc;
use sluice_trace::{
    extract, now_unix_nanos, SamplerKind, Span, SpanBuilder, Tracer, TracingConfig,
};
use std::time::{Duration, Instant};

const PARENT: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One request's tracing work; `sampled` picks the caller's flag.
fn request(t: &Tracer, parent: &[u8]) -> usize {
    let (server, client, n) = spans_of(t, parent);
    t.end(client, now_unix_nanos());
    t.end(server, now_unix_nanos());
    n
}

/// A sampled request's two spans as the exporter receives them.
fn sampled_spans(t: &Tracer) -> Vec<Span> {
    let (server, client, _) = spans_of(t, PARENT);
    vec![
        server.span().unwrap().clone(),
        client.span().unwrap().clone(),
    ]
}

/// The request path's work up to ending the spans.
fn spans_of(t: &Tracer, parent: &[u8]) -> (SpanBuilder, SpanBuilder, usize) {
    let incoming = extract(Some(parent), [b"congo=t61rcWkgMzE".as_slice()]);
    let mut server = t.start_server(incoming.as_ref(), "chat", now_unix_nanos());
    let mut client = t.start_client(&server, "request", now_unix_nanos());
    let traceparent = client.traceparent();
    let header = http::HeaderValue::from_bytes(traceparent.as_bytes()).unwrap();
    if client.is_recording() {
        client.set_name(sc::span_name(sc::OP_CHAT, "llama-3-70b"));
        client.set(sc::GEN_AI_OPERATION_NAME, sc::OP_CHAT);
        client.set(sc::GEN_AI_PROVIDER_NAME, sc::PROVIDER_VLLM);
        client.set(sc::GEN_AI_REQUEST_MODEL, "llama-3-70b");
        client.set(sc::GEN_AI_REQUEST_STREAM, false);
        client.set(sc::SERVER_ADDRESS, "10.0.0.11");
        client.set(sc::SERVER_PORT, 8000u16);
        client.set(sc::SLUICE_ATTEMPT, 1u32);
        client.set(sc::SLUICE_POOL, "on-demand");
        client.set(sc::GEN_AI_REQUEST_MAX_TOKENS, 256i64);
        client.set(sc::GEN_AI_RESPONSE_MODEL, "llama-3-70b");
        client.set(sc::GEN_AI_USAGE_INPUT_TOKENS, 42u64);
        client.set(sc::GEN_AI_USAGE_OUTPUT_TOKENS, 256u64);
        client.set(sc::HTTP_RESPONSE_STATUS_CODE, 200u16);
    }
    let trace_id = server.context().trace_id.to_hex();
    if server.is_recording() {
        server.set_name(sc::span_name(sc::OP_CHAT, "llama-3-70b"));
        server.set(sc::HTTP_REQUEST_METHOD, "POST");
        server.set(sc::URL_PATH, "/v1/chat/completions");
        server.set(sc::HTTP_RESPONSE_STATUS_CODE, 200u16);
        server.set(sc::GEN_AI_OPERATION_NAME, sc::OP_CHAT);
        server.set(sc::GEN_AI_PROVIDER_NAME, sc::PROVIDER_VLLM);
        server.set(sc::GEN_AI_REQUEST_STREAM, false);
        server.set(sc::GEN_AI_REQUEST_MODEL, "llama-3-70b");
        server.set(sc::GEN_AI_REQUEST_MAX_TOKENS, 512i64);
        server.set(sc::GEN_AI_RESPONSE_MODEL, "llama-3-70b");
        server.set(sc::GEN_AI_RESPONSE_FINISH_REASONS, &["length"][..]);
        server.set(sc::GEN_AI_USAGE_INPUT_TOKENS, 42u64);
        server.set(sc::GEN_AI_USAGE_OUTPUT_TOKENS, 256u64);
        server.set(sc::SLUICE_REQUEST_ID, "sluice-0-18f2c-00002a");
        server.set(sc::SLUICE_TENANT, "coding-assistant");
        server.set(sc::SLUICE_TIER, "Standard");
        server.set(sc::SLUICE_DECISION, "degrade");
        server.set(sc::SLUICE_REASON, "degrade_cache_nearly_full");
        server.set(sc::SLUICE_POOL, "on-demand");
        server.set(sc::SLUICE_LEVEL, 1.0);
        server.set(sc::SLUICE_MAX_TOKENS_REQUESTED, 512i64);
        server.set(sc::SLUICE_MAX_TOKENS_APPLIED, 256i64);
        server.set(sc::SLUICE_MODEL_ROUTED, "llama-3-70b");
    }
    (server, client, trace_id.len() + header.len())
}

fn per_request(t: &Tracer, parent: &[u8], n: u32, drain: &dyn Fn()) -> Duration {
    let mut total = Duration::ZERO;
    let mut sink = 0;
    for _ in 0..n / 1000 {
        let start = Instant::now();
        for _ in 0..1000 {
            sink += request(t, parent);
        }
        total += start.elapsed();
        drain();
    }
    assert!(sink > 0);
    total / n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
async fn the_request_paths_cost() {
    let cfg = TracingConfig {
        enabled: true,
        sampler: SamplerKind::ParentbasedAlwaysOn,
        queue_spans: 4096,
        ..Default::default()
    };
    let (t, exporter) = Tracer::from_config(&cfg).unwrap();
    let exporter = std::sync::Mutex::new(exporter.unwrap());
    // The exporter is not run: its queue is emptied between rounds, off the clock.
    let drain = || {
        exporter.lock().unwrap().discard_queued();
    };
    let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    for _ in 0..2 {
        per_request(&t, PARENT, 20_000, &drain);
    }
    let sampled = per_request(&t, PARENT, 200_000, &drain);
    let not = per_request(&t, unsampled, 200_000, &drain);
    // With tracing off the proxy does none of this (no header read, nothing allocated).
    println!(
        "per request: sampled {sampled:?} (SERVER 25 + CLIENT 13 attributes), unsampled {not:?}"
    );
    // The exporter's share, off the request path but on the same cores: encoding a batch of
    // 512 spans (256 requests' SERVER and CLIENT) into one export request.
    let spans = sampled_spans(&t);
    let batch: Vec<&Span> = spans.iter().cycle().take(512).collect();
    let resource = encode_resource(&[("service.name".into(), "sluice".into())]);
    let scope = Scope {
        name: "sluice",
        version: "0",
    };
    let mut buf = Vec::new();
    let rounds = 2_000;
    let start = Instant::now();
    let mut bytes = 0;
    for _ in 0..rounds {
        let at = encode_request(&mut buf, &resource, &scope, batch.iter().copied());
        bytes += buf.len() - at;
    }
    println!(
        "encoding for export: {:?} a request ({} B a request)",
        start.elapsed() / (rounds * 256),
        bytes / (rounds as usize * 256)
    );
    assert_eq!(
        t.stats()
            .spans_dropped
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
