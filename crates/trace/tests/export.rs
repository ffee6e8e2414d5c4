//! The exporter against the testkit's OTLP receiver: what arrives (ids, parents, kinds,
//! attributes, resource), batching by size and by time, and that a collector that is down, slow
//! or refusing costs the request path nothing.

use sluice_testkit::otlp::otlp_proto::trace::v1::span::SpanKind as PKind;
use sluice_testkit::{OtlpMode, OtlpReceiver};
use sluice_trace::semconv as sc;
use sluice_trace::{extract, now_unix_nanos, SamplerKind, Tracer, TracingConfig};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);

struct Running {
    tracer: Tracer,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    async fn shutdown(self) -> Tracer {
        self.stop.send_replace(true);
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the exporter stops")
            .expect("the exporter does not panic");
        self.tracer
    }
}

fn config(rx: &OtlpReceiver, f: impl FnOnce(&mut TracingConfig)) -> TracingConfig {
    let mut c = TracingConfig {
        enabled: true,
        endpoint: Some(rx.endpoint()),
        sampler: SamplerKind::AlwaysOn,
        flush_ms: 50,
        timeout_ms: 1000,
        ..Default::default()
    };
    f(&mut c);
    c
}

fn start(cfg: &TracingConfig) -> Running {
    let (tracer, exporter) = Tracer::from_config(cfg).unwrap();
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(exporter.unwrap().run(stop_rx));
    Running { tracer, stop, task }
}

/// One recorded root span, ended at once.
fn emit(t: &Tracer, name: &'static str) {
    let mut s = t.start_server(None, name, now_unix_nanos());
    s.set(sc::SLUICE_TIER, "Standard");
    t.end(s, now_unix_nanos());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_arrive_with_their_ids_parents_kinds_attributes_and_resource() {
    let rx = OtlpReceiver::start().await;
    let mut cfg = config(&rx, |c| c.sampler = SamplerKind::ParentbasedTraceIdRatio);
    let env = |k: &str| match k {
        "OTEL_SERVICE_NAME" => Some("sluice-test".to_string()),
        "OTEL_RESOURCE_ATTRIBUTES" => Some("deployment.environment.name=ci%20run".to_string()),
        _ => None,
    };
    assert!(cfg.apply_env(&env).unwrap().is_empty());
    let run = start(&cfg);
    let t = &run.tracer;

    let incoming = extract(
        Some(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".as_slice()),
        [b"congo=t61rcWkgMzE".as_slice()],
    );
    let t0 = now_unix_nanos();
    let mut server = t.start_server(incoming.as_ref(), "chat llama-3-70b", t0);
    server.set(sc::GEN_AI_OPERATION_NAME, sc::OP_CHAT);
    server.set(sc::GEN_AI_REQUEST_MODEL, "llama-3-70b");
    server.set(sc::GEN_AI_REQUEST_MAX_TOKENS, 400u32);
    server.set(sc::GEN_AI_REQUEST_STREAM, true);
    server.set(
        sc::SLUICE_TENANT,
        std::sync::Arc::<str>::from("support-bot"),
    );
    server.set(sc::SLUICE_TIER, "Guaranteed");
    server.set(sc::SLUICE_DECISION, "degrade");
    server.set(sc::SLUICE_QUEUE_WAIT_MS, 12.5);
    server.set(sc::SLUICE_MAX_TOKENS_APPLIED, 256u32);
    server.add_event("sluice.admitted", t0 + 1_000, |a| {
        a.set(sc::SLUICE_POOL, "on-demand");
    });
    let mut client = t.start_client(&server, "chat llama-3-70b", t0 + 2_000);
    client.set(sc::SLUICE_ATTEMPT, 1u32);
    client.set(sc::SERVER_ADDRESS, "10.0.0.11");
    client.set(sc::SERVER_PORT, 8000u16);
    client.set(sc::GEN_AI_USAGE_OUTPUT_TOKENS, 256u64);
    client.set(sc::GEN_AI_RESPONSE_FINISH_REASONS, vec!["length"]);
    let sent = client.traceparent();
    client.set_error("timeout", "upstream read timed out");
    t.end(client, t0 + 5_000);
    t.end(server, t0 + 6_000);

    let spans = rx.wait_for_spans(2, WAIT).await.unwrap();
    assert_eq!(spans.len(), 2);
    let server = &rx.by_kind(PKind::Server)[0];
    let client = &rx.by_kind(PKind::Client)[0];
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    assert_eq!(rx.by_trace(trace).len(), 2);
    assert_eq!(server.parent_span_id(), "00f067aa0ba902b7");
    assert_eq!(client.parent_span_id(), server.span_id());
    assert_eq!(
        &sent.as_str()[36..52],
        client.span_id(),
        "vLLM hangs under it"
    );
    assert_eq!(server.span.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(server.span.flags & 0x3ff, 0x301, "sampled, remote parent");
    assert_eq!(client.span.flags & 0x3ff, 0x101, "sampled, local parent");
    assert_eq!(server.name(), "chat llama-3-70b");
    assert_eq!(server.span.start_time_unix_nano, t0);
    assert_eq!(server.span.end_time_unix_nano, t0 + 6_000);
    assert_eq!(server.attr_str("gen_ai.operation.name"), Some("chat"));
    assert_eq!(server.attr_i64("gen_ai.request.max_tokens"), Some(400));
    assert_eq!(server.attr_bool("gen_ai.request.stream"), Some(true));
    assert_eq!(server.attr_str("sluice.tenant"), Some("support-bot"));
    assert_eq!(server.attr_f64("sluice.queue_wait_ms"), Some(12.5));
    assert_eq!(server.events(), vec![("sluice.admitted", t0 + 1_000)]);
    assert_eq!(client.attr_i64("sluice.attempt"), Some(1));
    assert_eq!(client.attr_i64("server.port"), Some(8000));
    assert_eq!(
        client.attr_strs("gen_ai.response.finish_reasons"),
        Some(vec!["length".to_string()])
    );
    assert_eq!(client.attr_str("error.type"), Some("timeout"));
    let status = client.span.status.as_ref().unwrap();
    assert_eq!(
        (status.code, status.message.as_str()),
        (2, "upstream read timed out")
    );
    assert_eq!(server.resource_str("service.name"), Some("sluice-test"));
    assert_eq!(
        server.resource_str("deployment.environment.name"),
        Some("ci run")
    );
    assert_eq!(server.scope_name, "sluice");
    let req = &rx.requests()[0];
    assert_eq!(req.path, "/v1/traces");
    assert_eq!(req.content_type.as_deref(), Some("application/x-protobuf"));

    let t = run.shutdown().await;
    assert_eq!(t.stats().spans_exported.load(Relaxed), 2);
    assert_eq!(t.stats().batches_failed.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsampled_requests_export_nothing() {
    let rx = OtlpReceiver::start().await;
    let run = start(&config(&rx, |c| {
        c.sampler = SamplerKind::ParentbasedTraceIdRatio;
        c.ratio = 0.0;
    }));
    for _ in 0..10 {
        emit(&run.tracer, "chat m");
    }
    let t = run.shutdown().await;
    assert!(rx.requests().is_empty());
    assert_eq!(t.stats().spans_exported.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_leaves_at_once() {
    let rx = OtlpReceiver::start().await;
    let run = start(&config(&rx, |c| {
        c.batch_spans = 4;
        c.flush_ms = 60_000;
    }));
    let began = Instant::now();
    for _ in 0..8 {
        emit(&run.tracer, "chat m");
    }
    let reqs = rx.wait_for_requests(2, WAIT).await.unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "not held for flush_ms"
    );
    assert_eq!(reqs.iter().map(|r| r.spans).collect::<Vec<_>>(), vec![4, 4]);
    for _ in 0..3 {
        emit(&run.tracer, "chat m");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(rx.requests().len(), 2, "a partial batch waits for flush_ms");
    let t = run.shutdown().await;
    assert_eq!(rx.requests().len(), 3, "shutdown sends what is queued");
    assert_eq!(rx.spans().len(), 11);
    assert_eq!(t.stats().spans_exported.load(Relaxed), 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_batch_leaves_after_flush_ms() {
    let rx = OtlpReceiver::start().await;
    let run = start(&config(&rx, |c| {
        c.batch_spans = 512;
        c.flush_ms = 400;
    }));
    let began = Instant::now();
    for _ in 0..3 {
        emit(&run.tracer, "chat m");
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(rx.requests().is_empty(), "held until flush_ms");
    let reqs = rx.wait_for_requests(1, WAIT).await.unwrap();
    assert!(
        began.elapsed() >= Duration::from_millis(300),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(reqs[0].spans, 3);
    run.shutdown().await;
}

/// The longest single `end` and the total of `n`, on a span already built.
fn time_ends(t: &Tracer, n: usize) -> (Duration, Duration) {
    let mut worst = Duration::ZERO;
    let began = Instant::now();
    for _ in 0..n {
        let s = t.start_server(None, "chat m", 1);
        let at = Instant::now();
        t.end(s, 2);
        worst = worst.max(at.elapsed());
    }
    (worst, began.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_collector_costs_the_submitter_nothing() {
    let rx = OtlpReceiver::start().await;
    rx.set_mode(OtlpMode::Down);
    let run = start(&config(&rx, |c| {
        c.queue_spans = 64;
        c.batch_spans = 16;
        c.flush_ms = 10;
        c.timeout_ms = 200;
    }));
    let (worst, total) = time_ends(&run.tracer, 20_000);
    assert!(total < Duration::from_secs(2), "20000 ends took {total:?}");
    assert!(worst < Duration::from_millis(50), "one end took {worst:?}");
    let stats = run.tracer.stats().clone();
    assert!(
        stats.spans_dropped.load(Relaxed) > 0,
        "the full queue drops"
    );
    let deadline = Instant::now() + WAIT;
    while stats.batches_failed.load(Relaxed) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(stats.batches_failed.load(Relaxed) > 0);
    let why = stats.last_error().unwrap();
    assert!(why.contains("unreachable"), "{why}");
    run.shutdown().await;
    let counted = stats.spans_exported.load(Relaxed)
        + stats.spans_dropped.load(Relaxed)
        + stats.spans_failed.load(Relaxed);
    assert_eq!(counted, 20_000, "every span is accounted for");
    assert!(rx.spans().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_collector_is_timed_out_and_costs_the_submitter_nothing() {
    let rx = OtlpReceiver::start().await;
    rx.set_mode(OtlpMode::Slow(Duration::from_secs(3)));
    let run = start(&config(&rx, |c| {
        c.queue_spans = 256;
        c.batch_spans = 8;
        c.flush_ms = 20;
        c.timeout_ms = 150;
    }));
    let began = Instant::now();
    let mut worst = Duration::ZERO;
    while began.elapsed() < Duration::from_millis(800) {
        let (w, _) = time_ends(&run.tracer, 50);
        worst = worst.max(w);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(worst < Duration::from_millis(50), "one end took {worst:?}");
    let stats = run.tracer.stats().clone();
    assert!(stats.batches_failed.load(Relaxed) >= 1);
    assert!(stats
        .last_error()
        .unwrap()
        .contains("timed out after 150 ms"));
    assert!(
        stats.spans_dropped.load(Relaxed) > 0,
        "the queue filled while the exporter waited"
    );
    assert!(rx.spans().is_empty(), "the collector never got to answer");
    // Backoff: at most ~1 attempt per doubling wait, not one per flush_ms (40 in 800 ms).
    let attempts = rx.requests().len();
    assert!((1..=8).contains(&attempts), "{attempts} attempts");
    rx.set_mode(OtlpMode::Down);
    run.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_collector_is_backed_off_and_then_recovers() {
    let rx = OtlpReceiver::start().await;
    rx.set_mode(OtlpMode::Refuse);
    let run = start(&config(&rx, |c| {
        c.batch_spans = 1;
        c.flush_ms = 25;
    }));
    let began = Instant::now();
    while began.elapsed() < Duration::from_millis(1200) {
        emit(&run.tracer, "chat m");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = run.tracer.stats().clone();
    let attempts = rx.requests().len();
    // 25, 50, 100, 200, 400, 800 ms: about 6 attempts, not ~100.
    assert!((2..=10).contains(&attempts), "{attempts} attempts");
    let failed = stats.batches_failed.load(Relaxed);
    assert!(
        failed + 1 >= attempts as u64 && failed >= 2,
        "{failed} of {attempts}"
    );
    assert!(stats.last_error().unwrap().starts_with("HTTP 500"));

    rx.set_mode(OtlpMode::Accept);
    let deadline = Instant::now() + WAIT;
    while rx.spans().is_empty() && Instant::now() < deadline {
        emit(&run.tracer, "chat m");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !rx.spans().is_empty(),
        "exports resume once the collector is back"
    );
    while stats.consecutive_failures.load(Relaxed) != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stats.consecutive_failures.load(Relaxed), 0);
    run.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_overflow_drops_and_counts_without_an_exporter_running() {
    let rx = OtlpReceiver::start().await;
    let cfg = config(&rx, |c| {
        c.queue_spans = 8;
        c.batch_spans = 4;
    });
    let (tracer, exporter) = Tracer::from_config(&cfg).unwrap();
    for _ in 0..20 {
        emit(&tracer, "chat m");
    }
    assert_eq!(tracer.queued(), 8);
    assert_eq!(tracer.stats().spans_dropped.load(Relaxed), 12);
    drop(exporter);
    emit(&tracer, "chat m");
    assert_eq!(
        tracer.stats().spans_dropped.load(Relaxed),
        13,
        "an exporter gone counts as dropped too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_comes_back_after_being_down() {
    let rx = OtlpReceiver::start().await;
    let run = start(&config(&rx, |c| c.batch_spans = 1));
    emit(&run.tracer, "first");
    rx.wait_for_spans(1, WAIT).await.unwrap();
    rx.set_mode(OtlpMode::Down);
    tokio::time::sleep(Duration::from_millis(100)).await;
    emit(&run.tracer, "lost");
    let stats = run.tracer.stats().clone();
    let deadline = Instant::now() + WAIT;
    while stats.batches_failed.load(Relaxed) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        stats.batches_failed.load(Relaxed),
        1,
        "the pooled connection was cut"
    );
    rx.set_mode(OtlpMode::Accept);
    let deadline = Instant::now() + WAIT;
    while rx.by_name("again").is_empty() && Instant::now() < deadline {
        emit(&run.tracer, "again");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(!rx.by_name("again").is_empty());
    assert!(rx.by_name("lost").is_empty());
    run.shutdown().await;
}
