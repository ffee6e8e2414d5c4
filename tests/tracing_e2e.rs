//! One trace from the client through Sluice into vLLM, over real HTTP: `sluice serve` and
//! `sluice sim` processes, and the testkit's OTLP receiver as the collector. A caller's
//! `traceparent` is continued and Sluice's CLIENT span is the parent of what the backend
//! received; the spans carry the GenAI and Sluice attributes (a capped request's applied
//! `max_tokens` included); a refusal has its SERVER span and no CLIENT span; a failover has a
//! CLIENT span per attempt; `/decisions/recent` carries the trace id; with tracing off nothing
//! changes on the wire; a collector that is down or slow costs requests nothing; the spans of a
//! stream that ends while the process drains are exported before it exits; `sluice demo` exports
//! when the OTEL_* variables name a collector.

mod common;
use common::*;
use serde_json::{json, Value};
use sluice_testkit::otlp::otlp_proto::trace::v1::span::SpanKind;
use sluice_testkit::{OtlpMode, OtlpReceiver, ReceivedSpan};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "llama-3-70b";
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
/// OTLP's `STATUS_CODE_ERROR`.
const STATUS_ERROR: i32 = 2;

fn traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

/// What Sluice sends in a trace it started: sampled, and its trace id random (W3C level 2).
fn own_traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-03")
}

/// Tracing on, everything sampled, exported to `rx` every 50 ms.
fn tracing(rx: &OtlpReceiver) -> Value {
    json!({"telemetry": {"tracing": {
        "enabled": true, "endpoint": rx.endpoint(), "sampler": "parentbased_always_on",
        "flush_ms": 50, "timeout_ms": 1000,
    }}})
}

/// Adaptive mode over an on-demand and a spot simulator, traced to `rx`.
fn adaptive(od: &Proc, sp: &Proc, rx: &OtlpReceiver) -> Value {
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"policy": {"mode": "adaptive",
                          "adaptive": {"window_ms": 2500, "min_samples": 3, "hold_ms": 500}}}),
    );
    merge(&mut cfg, tracing(rx));
    cfg
}

/// The spans of `trace` once there are at least `n`.
async fn trace_spans(rx: &OtlpReceiver, trace: &str, n: usize) -> Vec<ReceivedSpan> {
    wait_for(
        Duration::from_secs(10),
        &format!("{n} spans of trace {trace}"),
        || async {
            let spans = rx.by_trace(trace);
            (spans.len() >= n).then_some(spans)
        },
    )
    .await
}

fn of_kind(spans: &[ReceivedSpan], kind: SpanKind) -> Vec<&ReceivedSpan> {
    let mut out: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.kind() == kind).collect();
    out.sort_by_key(|s| s.attr_i64("sluice.attempt"));
    out
}

fn port(addr: &str) -> i64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// The trace context of the last completion `sim` received.
async fn last_received(sim: &Proc) -> (Value, Value) {
    let st = sim_stats(sim).await;
    let recent = st["recent"].as_array().unwrap();
    let last = recent.last().expect("the simulator received a completion");
    let tps = st["last_traceparents"].as_array().unwrap();
    assert_eq!(tps.last(), Some(&last["traceparent"]), "{st}");
    (last["traceparent"].clone(), last["tracestate"].clone())
}

async fn post(
    s: &Sluice,
    tenant: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = client()
        .post(s.url("/v1/chat/completions"))
        .header("x-tenant-id", tenant)
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_trace_runs_through_sluice_into_the_backend() {
    let rx = OtlpReceiver::start().await;
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b,llama-3-8b", &[]).await;
    let s = serve(&adaptive(&od, &sp, &rx)).await;
    let st = s.status().await["telemetry"]["tracing"].clone();
    assert_eq!(st["enabled"], true, "{st}");
    assert_eq!(st["endpoint"], rx.traces_url(), "{st}");
    assert_eq!(st["sampler"], "parentbased_always_on", "{st}");

    // A caller's trace: continued, its tracestate carried to the backend.
    let r = post(
        &s,
        "support-bot",
        chat_body(MODEL, Some(20)),
        &[
            ("traceparent", &traceparent(CALLER_TRACE, CALLER_SPAN)),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("x-request-id", "tr-caller"),
        ],
    )
    .await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    let spans = trace_spans(&rx, CALLER_TRACE, 2).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    let clients = of_kind(&spans, SpanKind::Client);
    assert_eq!(clients.len(), 1, "{spans:#?}");
    let client = clients[0];
    assert_eq!(
        server.parent_span_id(),
        CALLER_SPAN,
        "the caller's span is the parent"
    );
    assert_eq!(client.parent_span_id(), server.span_id());
    assert_eq!(
        (server.name(), client.name()),
        ("chat llama-3-70b", "chat llama-3-70b")
    );
    let (tp, ts) = last_received(&od).await;
    assert_eq!(
        tp,
        traceparent(CALLER_TRACE, &client.span_id()),
        "the backend's parent is the CLIENT span"
    );
    assert_eq!(ts, "congo=t61rcWkgMzE");

    for (key, want) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "vllm"),
        ("gen_ai.request.model", MODEL),
        ("gen_ai.response.model", MODEL),
        ("sluice.tenant", "support-bot"),
        ("sluice.tier", "Guaranteed"),
        ("sluice.decision", "pass"),
        ("sluice.reason", "admitted_slo_headroom"),
        ("sluice.pool", "on-demand"),
        ("sluice.model.routed", MODEL),
        ("sluice.request_id", "tr-caller"),
    ] {
        assert_eq!(server.attr_str(key), Some(want), "{key}: {server:#?}");
    }
    assert_eq!(server.attr_i64("gen_ai.request.max_tokens"), Some(20));
    assert_eq!(server.attr_i64("sluice.max_tokens.requested"), Some(20));
    assert_eq!(server.attr_i64("http.response.status_code"), Some(200));
    assert_eq!(server.attr_bool("gen_ai.request.stream"), Some(false));
    assert!(
        server.attr_f64("sluice.level").is_some(),
        "adaptive mode: {server:#?}"
    );
    let usage = &answer["usage"];
    assert_eq!(
        server.attr_i64("gen_ai.usage.output_tokens"),
        usage["completion_tokens"].as_i64()
    );
    assert_eq!(
        server.attr_i64("gen_ai.usage.input_tokens"),
        usage["prompt_tokens"].as_i64()
    );
    let finish = answer["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(
        server.attr_strs("gen_ai.response.finish_reasons"),
        Some(vec![finish.to_string()])
    );
    assert_eq!(server.resource_str("service.name"), Some("sluice"));
    assert_eq!(client.attr_str("server.address"), Some("127.0.0.1"));
    assert_eq!(client.attr_i64("server.port"), Some(port(&od.addr)));
    assert_eq!(client.attr_i64("sluice.attempt"), Some(1));
    assert_eq!(client.attr_i64("gen_ai.request.max_tokens"), Some(20));
    assert_eq!(client.attr_str("gen_ai.request.model"), Some(MODEL));
    assert!(client.attr_str("error.type").is_none(), "{client:#?}");
    assert!(
        server.span.start_time_unix_nano <= client.span.start_time_unix_nano
            && client.span.end_time_unix_nano <= server.span.end_time_unix_nano,
        "the attempt lies within the request"
    );
    let record = s.record("tr-caller").await;
    assert_eq!(record["trace_id"], CALLER_TRACE, "{record}");

    // No caller context: Sluice starts a trace, and the record names it.
    let r = post(
        &s,
        "support-bot",
        chat_body(MODEL, Some(5)),
        &[("x-request-id", "tr-root")],
    )
    .await;
    assert_eq!(r.status(), 200);
    let record = s.record("tr-root").await;
    let root = record["trace_id"].as_str().expect("a trace id").to_string();
    let spans = trace_spans(&rx, &root, 2).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    assert_eq!(server.parent_span_id(), "", "a root span");
    let client = of_kind(&spans, SpanKind::Client)[0].clone();
    assert_eq!(
        last_received(&od).await.0,
        own_traceparent(&root, &client.span_id())
    );

    // A stream: its first token is an event of the request, its finish reason read from the
    // stream's tail.
    let mut body = chat_body(MODEL, Some(8));
    body["stream"] = json!(true);
    let r = post(&s, "support-bot", body, &[("x-request-id", "tr-stream")]).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let record = s.record("tr-stream").await;
    let spans = trace_spans(&rx, record["trace_id"].as_str().unwrap(), 2).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    assert_eq!(server.attr_bool("gen_ai.request.stream"), Some(true));
    assert!(
        server.attr_strs("gen_ai.response.finish_reasons").is_some(),
        "{server:#?}"
    );
    let first_token = server
        .events()
        .into_iter()
        .find(|(n, _)| *n == "sluice.first_token");
    let (_, at) = first_token.expect("the first token event");
    assert!(server.span.start_time_unix_nano < at && at <= server.span.end_time_unix_nano);

    // A malformed traceparent is not continued, and its tracestate is not passed on.
    let r = post(
        &s,
        "support-bot",
        chat_body(MODEL, Some(5)),
        &[
            (
                "traceparent",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            ),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("x-request-id", "tr-bad"),
        ],
    )
    .await;
    assert_eq!(r.status(), 200);
    let fresh = s.record("tr-bad").await["trace_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(fresh.to_uppercase(), CALLER_TRACE.to_uppercase());
    let (tp, ts) = last_received(&od).await;
    assert!(
        tp.as_str().unwrap().starts_with(&format!("00-{fresh}-")),
        "{tp}"
    );
    assert_eq!(ts, Value::Null);

    // The cache nearly full: Standard is capped to its brownout; the spans say what was asked
    // and what was sent.
    s.set_signal("/admin/pressure", 92.0).await;
    wait_for(Duration::from_secs(5), "the shaping floor", || async {
        let st = s.status().await;
        (st["admission_control"]["pools"]["on-demand"]["shaping"] == true).then_some(())
    })
    .await;
    let r = post(
        &s,
        "coding-assistant",
        chat_body(MODEL, Some(500)),
        &[("x-request-id", "tr-capped")],
    )
    .await;
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-sluice-reason")),
        (200, "degrade_cache_nearly_full")
    );
    let capped = s.record("tr-capped").await;
    let applied = capped["applied_max_tokens"].as_i64().unwrap();
    assert!(applied < 500, "{capped}");
    let spans = trace_spans(&rx, capped["trace_id"].as_str().unwrap(), 2).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    let client = of_kind(&spans, SpanKind::Client)[0].clone();
    assert_eq!(server.attr_str("sluice.decision"), Some("degrade"));
    assert_eq!(
        server.attr_str("sluice.reason"),
        Some("degrade_cache_nearly_full")
    );
    assert_eq!(server.attr_i64("sluice.max_tokens.requested"), Some(500));
    assert_eq!(server.attr_i64("sluice.max_tokens.applied"), Some(applied));
    assert_eq!(
        server.attr_i64("gen_ai.request.max_tokens"),
        Some(500),
        "as the caller sent it"
    );
    assert_eq!(
        client.attr_i64("gen_ai.request.max_tokens"),
        Some(applied),
        "as vLLM got it"
    );
    assert_eq!(od_max_tokens(&od).await, applied);

    // At the rail Standard is refused before any backend: a SERVER span with the reason, no
    // CLIENT span, nothing sent.
    s.set_signal("/admin/pressure", 100.0).await;
    wait_for(Duration::from_secs(5), "the rail", || async {
        let st = s.status().await;
        (st["admission_control"]["pools"]["on-demand"]["moved"]["direction"] == "rail")
            .then_some(())
    })
    .await;
    let received = sim_stats(&od).await["received"].clone();
    let r = post(
        &s,
        "coding-assistant",
        chat_body(MODEL, Some(20)),
        &[("x-request-id", "tr-refused")],
    )
    .await;
    assert_eq!(r.status(), 429);
    let refused = s.record("tr-refused").await;
    let trace = refused["trace_id"].as_str().unwrap().to_string();
    let spans = trace_spans(&rx, &trace, 1).await;
    // The SERVER span is ended after the response; give a stray CLIENT span time to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spans = rx
        .by_trace(&trace)
        .into_iter()
        .chain(spans)
        .collect::<Vec<_>>();
    assert!(of_kind(&spans, SpanKind::Client).is_empty(), "{spans:#?}");
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    assert_eq!(server.attr_str("sluice.decision"), Some("reject"));
    assert_eq!(
        server.attr_str("sluice.reason"),
        Some("reject_pressure_rail")
    );
    assert_eq!(server.attr_str("sluice.tier"), Some("Standard"));
    assert_eq!(server.attr_i64("http.response.status_code"), Some(429));
    assert!(server.attr_str("sluice.pool").is_none());
    assert_ne!(
        server.span.status.as_ref().map_or(0, |st| st.code),
        STATUS_ERROR,
        "a refusal is not an error of the span"
    );
    assert_eq!(
        sim_stats(&od).await["received"],
        received,
        "nothing reached vLLM"
    );

    // Counted as exported, in /status and /metrics.
    let st = s.status().await["telemetry"]["tracing"].clone();
    assert!(st["spans_exported"].as_u64() >= Some(8), "{st}");
    assert_eq!(st["spans_dropped"], 0, "{st}");
    let m = s.metrics().await;
    assert!(
        m.lines().any(
            |l| l.starts_with("sluice_trace_spans_total{outcome=\"exported\"}")
                && !l.ends_with(" 0")
        ),
        "{m}"
    );
}

/// The `max_tokens` of the last completion `sim` received.
async fn od_max_tokens(sim: &Proc) -> i64 {
    let st = sim_stats(sim).await;
    st["recent"].as_array().unwrap().last().unwrap()["max_tokens"]
        .as_i64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_is_two_client_spans_under_one_server_span() {
    let rx = OtlpReceiver::start().await;
    let a = sim(MODEL, &[]).await;
    let b = sim(MODEL, &[]).await;
    let mut cfg = config(&[], &[]);
    let hc = json!({"path": "/health", "interval_ms": 1000, "timeout_ms": 1000,
                    "consecutive_success": 1, "consecutive_failure": 2});
    cfg["pools"] = json!({"on-demand": {
        "backends": [&a.addr, &b.addr], "health_check": hc,
        "selection": "round_robin", "ejection": {"consecutive_failures": 0},
    }});
    merge(&mut cfg, tracing(&rx));
    let s = serve(&cfg).await;
    // A answers 503 to every completion, as an overloaded replica does; /health stays 200.
    sim_admin(&a, "/admin/fail", json!({"mode": "status", "status": 503})).await;
    let mut failed_over = None;
    for i in 0..6 {
        let id = format!("tr-fo-{i}");
        let r = post(
            &s,
            "support-bot",
            chat_body(MODEL, Some(5)),
            &[("x-request-id", &id)],
        )
        .await;
        assert_eq!(r.status(), 200, "failover hides A's 503");
        let record = s.record(&id).await;
        if record["attempts"] == 2 {
            failed_over = Some(record);
            break;
        }
    }
    let record = failed_over.expect("round robin sends a request to A first within 6");
    let trace = record["trace_id"].as_str().unwrap();
    let spans = trace_spans(&rx, trace, 3).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    let clients = of_kind(&spans, SpanKind::Client);
    assert_eq!(clients.len(), 2, "{spans:#?}");
    let (first, second) = (clients[0], clients[1]);
    for c in &clients {
        assert_eq!(
            c.parent_span_id(),
            server.span_id(),
            "both attempts under the request"
        );
    }
    assert_eq!(
        (
            first.attr_i64("sluice.attempt"),
            second.attr_i64("sluice.attempt")
        ),
        (Some(1), Some(2))
    );
    assert_eq!(first.attr_i64("server.port"), Some(port(&a.addr)));
    assert_eq!(second.attr_i64("server.port"), Some(port(&b.addr)));
    assert_eq!(first.attr_str("error.type"), Some("503"));
    assert_eq!(first.attr_i64("http.response.status_code"), Some(503));
    assert_eq!(
        first.span.status.as_ref().map(|st| st.code),
        Some(STATUS_ERROR)
    );
    assert!(second.attr_str("error.type").is_none(), "{second:#?}");
    assert_eq!(second.attr_i64("http.response.status_code"), Some(200));
    assert!(first.span.end_time_unix_nano <= second.span.start_time_unix_nano);
    assert!(
        server.attr_str("error.type").is_none(),
        "the request succeeded"
    );
    // Each replica was sent its own attempt's context.
    assert_eq!(
        last_received(&a).await.0,
        own_traceparent(trace, &first.span_id())
    );
    assert_eq!(
        last_received(&b).await.0,
        own_traceparent(trace, &second.span_id())
    );
}

#[tokio::test]
async fn with_tracing_off_the_wire_is_untouched() {
    let od = sim(MODEL, &[]).await;
    let sp = sim(MODEL, &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    let st = s.status().await["telemetry"]["tracing"].clone();
    assert_eq!(st["enabled"], false, "{st}");
    // The caller's context reaches the backend byte for byte, an invalid one too.
    for (tp, ts) in [
        (traceparent(CALLER_TRACE, CALLER_SPAN), "congo=t61rcWkgMzE"),
        ("00-NOT-A-TRACEPARENT".to_string(), "a=1,,B=2"),
    ] {
        let r = post(
            &s,
            "support-bot",
            chat_body(MODEL, Some(5)),
            &[
                ("traceparent", &tp),
                ("tracestate", ts),
                ("x-request-id", "off-1"),
            ],
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(last_received(&od).await, (json!(tp), json!(ts)));
    }
    let r = post(
        &s,
        "support-bot",
        chat_body(MODEL, Some(5)),
        &[("x-request-id", "off-2")],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        last_received(&od).await,
        (Value::Null, Value::Null),
        "nothing injected"
    );
    assert_eq!(s.record("off-2").await["trace_id"], Value::Null);
}

/// Median of `n` sequential requests' latencies to `s`.
async fn median_latency(s: &Sluice, n: usize) -> Duration {
    let c = client();
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = c
            .post(s.url("/v1/chat/completions"))
            .header("x-tenant-id", "support-bot")
            .header("x-sim-output-tokens", "2")
            .json(&chat_body(MODEL, Some(2)))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
        times.push(t.elapsed());
    }
    times.sort();
    times[n / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_down_or_slow_costs_requests_nothing() {
    let rx = OtlpReceiver::start().await;
    let od = sim(MODEL, &[]).await;
    let sp = sim(MODEL, &[]).await;
    let off = serve(&config(&[&od.addr], &[&sp.addr])).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    // A small queue and a short bound, so a sick collector fills the queue within the test.
    merge(&mut cfg, tracing(&rx));
    merge(
        &mut cfg,
        json!({"telemetry": {"tracing": {"queue_spans": 8, "batch_spans": 4, "timeout_ms": 300}}}),
    );
    let on = serve(&cfg).await;
    let n = 31;
    median_latency(&off, 5).await;
    median_latency(&on, 5).await;
    for mode in [OtlpMode::Down, OtlpMode::Slow(Duration::from_secs(5))] {
        rx.set_mode(mode);
        let base = median_latency(&off, n).await;
        let traced = median_latency(&on, n).await;
        let base_again = median_latency(&off, n).await;
        let base = base.max(base_again);
        println!("collector {mode:?}: median {traced:?} traced, {base:?} untraced");
        // Generous: a request that waited on the collector would take its 300 ms bound.
        assert!(
            traced <= base * 2 + Duration::from_millis(25),
            "collector {mode:?}: median {traced:?} with tracing against {base:?} without"
        );
    }
    let st = wait_for(
        Duration::from_secs(10),
        "spans lost to the sick collector",
        || async {
            let st = on.status().await["telemetry"]["tracing"].clone();
            (st["spans_dropped"].as_u64() > Some(0) && st["spans_failed"].as_u64() > Some(0))
                .then_some(st)
        },
    )
    .await;
    assert!(st["last_error"].is_string(), "{st}");
    assert!(st["queued"].as_u64() <= Some(8), "{st}");
    let m = on.metrics().await;
    let count = |outcome: &str| {
        m.lines()
            .find(|l| {
                l.starts_with(&format!(
                    "sluice_trace_spans_total{{outcome=\"{outcome}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    assert!(
        count("dropped") > Some(0) && count("failed") > Some(0),
        "{m}"
    );
}

#[tokio::test]
async fn the_demo_exports_when_the_otel_variables_name_a_collector() {
    let rx = OtlpReceiver::start().await;
    let log = std::env::temp_dir().join(format!("sluice-demo-tracing-{}.log", std::process::id()));
    let mut started = None;
    for _ in 0..3 {
        let addr = format!("127.0.0.1:{}", free_port());
        let ops = format!("127.0.0.1:{}", free_port());
        let child = Command::new(BIN)
            .args(["demo", "--listen", &addr, "--ops-listen", &ops])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
            .env("OTEL_SERVICE_NAME", "sluice-demo")
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut demo = Proc::new(child, addr);
        if wait_started(&mut demo, &format!("http://{ops}/readyz"), &log).await {
            started = Some((demo, ops));
            break;
        }
    }
    let (demo, ops) = started.expect("the demo starts");
    let r = client()
        .post(demo.url("/v1/chat/completions"))
        .header("x-tenant-id", "support-bot")
        .header("traceparent", traceparent(CALLER_TRACE, CALLER_SPAN))
        .json(&chat_body(MODEL, Some(5)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let spans = trace_spans(&rx, CALLER_TRACE, 2).await;
    assert!(spans
        .iter()
        .all(|s| s.resource_str("service.name") == Some("sluice-demo")));
    let st = get_json(&format!("http://{ops}/status")).await;
    assert_eq!(st["telemetry"]["tracing"]["enabled"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_wait_is_on_the_server_span_before_the_attempt() {
    let rx = OtlpReceiver::start().await;
    let od = sim(MODEL, &[]).await;
    let sp = sim(MODEL, &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({"tiers": {"Standard": {"inflight_capacity": 1}},
               "queue": {"max_size": 4, "max_wait_seconds": 5}}),
    );
    merge(&mut cfg, tracing(&rx));
    let s = std::sync::Arc::new(serve(&cfg).await);
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 400})).await;
    let first = {
        let s = s.clone();
        tokio::spawn(
            async move { post(&s, "coding-assistant", chat_body(MODEL, Some(5)), &[]).await },
        )
    };
    wait_for(Duration::from_secs(5), "the slot taken", || async {
        (s.tier("Standard").await["inflight"] == 1).then_some(())
    })
    .await;
    let second = post(
        &s,
        "coding-assistant",
        chat_body(MODEL, Some(5)),
        &[("x-request-id", "tr-queued")],
    )
    .await;
    assert_eq!(header(&second, "x-sluice-decision"), "queue");
    assert_eq!(first.await.unwrap().status(), 200);
    let record = s.record("tr-queued").await;
    let spans = trace_spans(&rx, record["trace_id"].as_str().unwrap(), 2).await;
    let server = of_kind(&spans, SpanKind::Server)[0].clone();
    let client = of_kind(&spans, SpanKind::Client)[0].clone();
    let waited = server
        .attr_f64("sluice.queue_wait_ms")
        .expect("the queue wait");
    assert!(waited > 100.0, "{waited}");
    assert_eq!(server.attr_str("sluice.decision"), Some("queue"));
    assert_eq!(server.attr_str("sluice.reason"), Some("queue_released"));
    let left = server
        .events()
        .into_iter()
        .find(|(name, _)| *name == "sluice.queue.left")
        .expect("the queue event")
        .1;
    assert!(
        server.span.start_time_unix_nano + (waited * 1e6) as u64 <= left + 1_000_000
            && left <= client.span.start_time_unix_nano,
        "the wait, then the attempt: {server:#?} {client:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_during_the_drain_is_exported_before_exit() {
    let rx = OtlpReceiver::start().await;
    let od = sim(MODEL, &["--itl-ms", "30"]).await;
    let sp = sim(MODEL, &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(&mut cfg, tracing(&rx));
    // A flush interval longer than the test: only the exporter's last attempt sends the spans.
    merge(
        &mut cfg,
        json!({"server": {"grace_period_seconds": 20},
               "telemetry": {"tracing": {"flush_ms": 60000}}}),
    );
    let mut s = serve(&cfg).await;
    let mut body = chat_body(MODEL, Some(40));
    body["stream"] = json!(true);
    let r = post(&s, "support-bot", body, &[("x-request-id", "tr-drain")]).await;
    assert_eq!(r.status(), 200);
    let reader = tokio::spawn(r.text());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ok = Command::new("kill")
        .args(["-TERM", &s.pid().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let text = reader.await.unwrap().unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let exited = tokio::task::spawn_blocking(move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Some(st) = s.proc.child.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    })
    .await
    .unwrap();
    assert!(exited.is_some_and(|st| st.success()), "a clean exit");
    let spans = rx.find(|sp| sp.attr_str("sluice.request_id") == Some("tr-drain"));
    assert_eq!(
        spans.len(),
        1,
        "the stream's SERVER span was sent before the exit"
    );
    assert_eq!(
        rx.by_trace(&spans[0].trace_id()).len(),
        2,
        "and its CLIENT span"
    );
}
