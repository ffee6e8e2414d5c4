//! Distributed tracing on the request path: `sluice-trace`'s Pingora glue. A request gets a
//! SERVER span (continuing the caller's `traceparent` / `tracestate`, or starting a trace) when
//! `request_filter` starts; each upstream attempt a CLIENT span, child of it, started in
//! `upstream_peer` and sent to vLLM as the `traceparent` in `upstream_request_filter`, so vLLM's
//! `llm_request` span hangs under it; an attempt that fails over ends with its `error.type`;
//! `logging` ends the rest with the decision record's values and hands them to the export queue
//! (never waiting: `sluice_trace::export`).
//!
//! With tracing off (`telemetry.tracing.enabled: false`) every function returns at its first
//! line: no header is read or written and nothing is allocated. With tracing on, an unsampled
//! request allocates only the trace headers it sends and its trace id for the record;
//! attributes are built only for a sampled one.

use super::ctx::{Ctx, RequestSpans};
use super::ProxyState;
use http::{HeaderName, HeaderValue};
use memchr::memmem;
use pingora::http::RequestHeader;
use pingora::prelude::*;
use sluice_policy::PolicyMode;
use sluice_record::decision::{DecisionRecord, Text};
use sluice_record::Failure;
use sluice_trace::semconv as sc;
use sluice_trace::{extract, instant_unix_nanos, SpanBuilder};
use std::borrow::Cow;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Built once: a searcher costs more to build than to run over a short answer.
static MODEL_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"model\""));
static FINISH_REASON_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"finish_reason\""));

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// `request_filter`, first thing: the SERVER span, from Sluice's receipt of the request.
pub fn start(app: &ProxyState, session: &Session, ctx: &mut Ctx) {
    if !app.tracer.is_enabled() {
        return;
    }
    let req = session.req_header();
    let incoming = extract(
        req.headers.get(&TRACEPARENT).map(HeaderValue::as_bytes),
        req.headers
            .get_all(&TRACESTATE)
            .iter()
            .map(HeaderValue::as_bytes),
    );
    let started = instant_unix_nanos(ctx.started.unwrap_or_else(Instant::now));
    // Named for good in `finish`, once the model is known.
    let name = sc::operation_for_path(req.uri.path()).unwrap_or("request");
    let server = app.tracer.start_server(incoming.as_ref(), name, started);
    ctx.spans = Some(RequestSpans {
        server,
        client: None,
    });
}

/// The request left Sluice's queue after `waited`: admitted (`released`), or refused with
/// `outcome` as its reason.
pub fn queue_left(spans: &mut Option<RequestSpans>, waited: Duration, outcome: &'static str) {
    let Some(spans) = spans.as_mut().filter(|s| s.server.is_recording()) else {
        return;
    };
    let at = instant_unix_nanos(Instant::now());
    spans.server.add_event(sc::EVENT_QUEUE_LEFT, at, |a| {
        a.set(sc::SLUICE_QUEUE_WAIT_MS, millis(waited))
            .set(sc::SLUICE_QUEUE_OUTCOME, outcome);
    });
}

/// `upstream_peer`, once a backend is picked and `ctx.attempts` counts this attempt: its CLIENT
/// span.
pub fn attempt(app: &ProxyState, session: &Session, ctx: &mut Ctx, backend: &str) {
    let Some(spans) = ctx.spans.as_mut() else {
        return;
    };
    let now = instant_unix_nanos(Instant::now());
    // A failed attempt is ended where it failed; one that is not is ended here.
    if let Some(previous) = spans.client.take() {
        app.tracer.end(previous, now);
    }
    let mut client = app.tracer.start_client(&spans.server, "request", now);
    if client.is_recording() {
        let op = sc::operation_for_path(session.req_header().uri.path());
        let model = ctx
            .fallback_model
            .as_deref()
            .or_else(|| ctx.facts.as_ref().and_then(|f| f.model.as_deref()));
        client.set_name(sc::span_name(op.unwrap_or("request"), model.unwrap_or("")));
        if let Some(op) = op {
            client.set(sc::GEN_AI_OPERATION_NAME, op);
            client.set(sc::GEN_AI_PROVIDER_NAME, sc::PROVIDER_VLLM);
        }
        if let Some(m) = model {
            client.set(sc::GEN_AI_REQUEST_MODEL, m);
        }
        if let Some(f) = &ctx.facts {
            client.set(sc::GEN_AI_REQUEST_STREAM, f.stream);
        }
        let (address, port) = host_port(backend);
        client.set(sc::SERVER_ADDRESS, address);
        if let Some(port) = port {
            client.set(sc::SERVER_PORT, port);
        }
        client.set(sc::SLUICE_ATTEMPT, u32::from(ctx.attempts));
        if let Some(pool) = ctx.pool_label {
            client.set(sc::SLUICE_POOL, pool);
        }
    }
    spans.client = Some(client);
}

/// `upstream_request_filter`: the attempt's context toward vLLM (the caller's `tracestate`
/// with it, or none: a malformed one, or one that came with a malformed `traceparent`, is not
/// propagated).
pub fn inject(req: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    let Some(spans) = &ctx.spans else {
        return Ok(());
    };
    let span = spans.client.as_ref().unwrap_or(&spans.server);
    let traceparent = HeaderValue::from_bytes(span.traceparent().as_bytes())
        .or_err(pingora::ErrorType::InvalidHTTPHeader, "traceparent")?;
    req.insert_header_static("traceparent", traceparent);
    match span.trace_state() {
        Some(state) => {
            let value = HeaderValue::from_str(state.as_str())
                .or_err(pingora::ErrorType::InvalidHTTPHeader, "tracestate")?;
            req.insert_header_static("tracestate", value);
        }
        None => {
            req.remove_header(&TRACESTATE);
        }
    }
    Ok(())
}

/// An attempt failed and the request goes to another replica: its CLIENT span ends now, status
/// ERROR with `error_type` (the status code for a 5xx answer, else Pingora's error type).
pub fn attempt_failed(
    app: &ProxyState,
    ctx: &mut Ctx,
    status: Option<u16>,
    error_type: &dyn std::fmt::Display,
    message: &dyn std::fmt::Display,
) {
    let Some(mut client) = ctx.spans.as_mut().and_then(|s| s.client.take()) else {
        return;
    };
    if client.is_recording() {
        if let Some(code) = status {
            client.set(sc::HTTP_RESPONSE_STATUS_CODE, code);
        }
        client.set_error(error_type.to_string(), message.to_string());
    }
    app.tracer.end(client, instant_unix_nanos(Instant::now()));
}

/// `logging`: ends the spans with the record's values; the trace id for the record (`None` with
/// tracing off).
pub fn finish(
    app: &ProxyState,
    ctx: &mut Ctx,
    record: &DecisionRecord,
    e: Option<&pingora::Error>,
) -> Option<Text> {
    let RequestSpans { mut server, client } = ctx.spans.take()?;
    let trace_id = server.context().trace_id.to_hex();
    let now = Instant::now();
    let proxied = record.backend.is_some();
    let recording = server.is_recording();
    let answer = if recording && proxied {
        Answer::of(&ctx.response_tail)
    } else {
        Answer::default()
    };
    // The answer's attributes, set on the last CLIENT span, are copied to the SERVER span as
    // encoded there.
    let mut answer_set = false;
    if let Some(mut client) = client {
        if client.is_recording() {
            let first = client.attribute_count();
            answer.set_on(&mut client, record);
            if recording {
                server.copy_attributes(&client, first);
                answer_set = true;
            }
            end_attempt(&mut client, ctx, record, e);
        }
        let end = ctx.last_byte.filter(|_| ctx.error.is_none()).unwrap_or(now);
        app.tracer.end(client, instant_unix_nanos(end));
    }
    if recording {
        if !answer_set {
            answer.set_on(&mut server, record);
        }
        server_attributes(&mut server, ctx, record);
        if let (true, Some(first)) = (ctx.response_is_sse, ctx.first_byte) {
            server.add_event(sc::EVENT_FIRST_TOKEN, instant_unix_nanos(first), |_| {});
        }
    }
    app.tracer.end(server, instant_unix_nanos(now));
    Some(Cow::Owned(trace_id))
}

/// The last attempt's outcome on its CLIENT span (besides the answer's attributes).
fn end_attempt(
    client: &mut SpanBuilder,
    ctx: &Ctx,
    record: &DecisionRecord,
    e: Option<&pingora::Error>,
) {
    // As sent: the body's rewrite is done by now, a buffered one's included.
    if let Some(m) = record.applied_max_tokens {
        client.set(sc::GEN_AI_REQUEST_MAX_TOKENS, m);
    }
    let upstream_failure = matches!(
        ctx.error,
        Some(Failure::UpstreamError | Failure::UpstreamTimeout | Failure::ConnectError)
    );
    if upstream_failure {
        let kind = e.map_or_else(|| failure_name(ctx.error), |e| e.etype().as_str());
        let message = e.map_or_else(|| kind.to_string(), |e| e.to_string());
        client.set_error(kind.to_string(), message);
    } else if ctx.status > 0 {
        client.set(sc::HTTP_RESPONSE_STATUS_CODE, ctx.status);
        if ctx.status >= 500 {
            client.set_error(
                ctx.status.to_string(),
                format!("the backend answered {}", ctx.status),
            );
        }
    }
}

/// The request's name and attributes on its SERVER span, from its decision record.
fn server_attributes(server: &mut SpanBuilder, ctx: &Ctx, record: &DecisionRecord) {
    let op = sc::operation_for_path(&record.path);
    let name = match op {
        Some(op) => sc::span_name(op, record.requested_model.as_deref().unwrap_or("")),
        None => record.method.to_string(),
    };
    server.set_name(name);
    server.set(sc::HTTP_REQUEST_METHOD, &record.method);
    server.set(sc::URL_PATH, &record.path);
    if record.status > 0 {
        server.set(sc::HTTP_RESPONSE_STATUS_CODE, record.status);
    }
    if let Some(op) = op {
        server.set(sc::GEN_AI_OPERATION_NAME, op);
        server.set(sc::GEN_AI_PROVIDER_NAME, sc::PROVIDER_VLLM);
        server.set(sc::GEN_AI_REQUEST_STREAM, record.stream);
    }
    if let Some(m) = &record.requested_model {
        server.set(sc::GEN_AI_REQUEST_MODEL, m);
    }
    // As the client sent it; what went to vLLM is on the CLIENT span and below.
    if let Some(m) = record.requested_max_tokens {
        server.set(sc::GEN_AI_REQUEST_MAX_TOKENS, m);
    }
    server.set(sc::SLUICE_REQUEST_ID, &record.request_id);
    if !record.tenant.is_empty() {
        server.set(sc::SLUICE_TENANT, &record.tenant);
    }
    server.set(sc::SLUICE_TIER, &record.tier);
    server.set(sc::SLUICE_DECISION, record.decision.as_str());
    if !record.reason.is_empty() {
        server.set(sc::SLUICE_REASON, &record.reason);
    }
    if let Some(pool) = &record.pool {
        server.set(sc::SLUICE_POOL, pool);
    }
    if let Some(q) = record.queue_wait_ms {
        server.set(sc::SLUICE_QUEUE_WAIT_MS, q);
    }
    if let Some(level) = admission_level(ctx) {
        server.set(sc::SLUICE_LEVEL, level);
    }
    if let Some(m) = record.requested_max_tokens {
        server.set(sc::SLUICE_MAX_TOKENS_REQUESTED, m);
    }
    if let Some(m) = record.applied_max_tokens {
        server.set(sc::SLUICE_MAX_TOKENS_APPLIED, m);
    }
    if let Some(m) = &record.routed_model {
        server.set(sc::SLUICE_MODEL_ROUTED, m);
    }
    // A refusal (4xx) is the server doing its job, not an error of the span (as HTTP server
    // spans go); a 5xx or a failure of the request's own is.
    let failed = ctx
        .error
        .filter(|f| !matches!(f, Failure::ClientGone | Failure::Refused));
    if record.status >= 500 || failed.is_some() {
        let kind = match failed {
            Some(f) => f.as_str().to_string(),
            None => record.status.to_string(),
        };
        let message = if record.reason.is_empty() {
            kind.clone()
        } else {
            record.reason.to_string()
        };
        server.set_error(kind, message);
    }
}

/// The admission level of the pool the decision read (adaptive mode).
fn admission_level(ctx: &Ctx) -> Option<f64> {
    let inputs = ctx.inputs.as_ref()?;
    if inputs.mode != PolicyMode::Adaptive {
        return None;
    }
    let pool = ctx
        .decision
        .as_ref()
        .and_then(|d| d.pool.signal_index())
        .unwrap_or(0);
    inputs.pools.get(pool).map(|p| p.level)
}

/// What the backend's answer says of itself: the model that answered and why each choice ended.
#[derive(Debug, Default)]
struct Answer<'a> {
    model: Option<Cow<'a, str>>,
    finish_reasons: Vec<Cow<'a, str>>,
}

impl<'a> Answer<'a> {
    /// From the response `logging` kept: a whole JSON completion, or the tail of a stream.
    /// Read by key rather than parsed (a completion's text made the parse most of tracing's
    /// cost): `"model"` or `"finish_reason"` followed by `:` cannot occur inside a JSON string,
    /// whose quotes would be escaped, so each match is a key. The first `model` is the
    /// answer's (nothing inside a choice has one); every string `finish_reason` is a choice's
    /// ending, which a stream sends once per choice. A stream's tail may begin inside an event:
    /// a key cut there does not match.
    fn of(tail: &'a [u8]) -> Answer<'a> {
        Answer {
            model: string_values(tail, &MODEL_KEY).next(),
            finish_reasons: string_values(tail, &FINISH_REASON_KEY).collect(),
        }
    }

    /// The response attributes, on the SERVER or the last CLIENT span.
    fn set_on(&self, span: &mut SpanBuilder, record: &DecisionRecord) {
        if let Some(m) = &self.model {
            span.set(sc::GEN_AI_RESPONSE_MODEL, m);
        }
        if !self.finish_reasons.is_empty() {
            span.set(sc::GEN_AI_RESPONSE_FINISH_REASONS, &self.finish_reasons);
        }
        if let Some(n) = record.prompt_tokens {
            span.set(sc::GEN_AI_USAGE_INPUT_TOKENS, n);
        }
        if let Some(n) = record.completion_tokens {
            span.set(sc::GEN_AI_USAGE_OUTPUT_TOKENS, n);
        }
    }
}

/// The string values of every `key` (quoted, as it appears in JSON) in `json`, in order;
/// other values (`null`, numbers) are skipped.
fn string_values<'a>(
    json: &'a [u8],
    key: &'a memmem::Finder<'static>,
) -> impl Iterator<Item = Cow<'a, str>> + 'a {
    key.find_iter(json).filter_map(move |at| {
        let value = json[at + key.needle().len()..]
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        let body = value.strip_prefix(b"\"")?;
        match memchr::memchr2(b'"', b'\\', body) {
            Some(end) if body[end] == b'"' => {
                std::str::from_utf8(&body[..end]).ok().map(Cow::Borrowed)
            }
            // Escapes: serde reads the one string.
            Some(_) => {
                let mut de = serde_json::Deserializer::from_slice(value);
                <String as serde::Deserialize>::deserialize(&mut de)
                    .ok()
                    .map(Cow::Owned)
            }
            None => None,
        }
    })
}

fn failure_name(f: Option<Failure>) -> &'static str {
    f.map_or("_OTHER", Failure::as_str)
}

/// `host:port` (`[v6]:port`) as `server.address` and `server.port`.
fn host_port(backend: &str) -> (&str, Option<u16>) {
    match backend.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => match port.parse() {
            Ok(p) => (host.trim_start_matches('[').trim_end_matches(']'), Some(p)),
            Err(_) => (backend, None),
        },
        _ => (backend, None),
    }
}

/// Milliseconds to the microsecond (as the record prints them).
fn millis(d: Duration) -> f64 {
    ((d.as_nanos() + 500) / 1000) as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::{host_port, Answer};

    #[test]
    fn backends_split_into_address_and_port() {
        assert_eq!(host_port("10.0.0.11:8000"), ("10.0.0.11", Some(8000)));
        assert_eq!(host_port("[::1]:8000"), ("::1", Some(8000)));
        assert_eq!(host_port("vllm.internal"), ("vllm.internal", None));
    }

    #[test]
    fn the_answer_names_its_model_and_finish_reasons() {
        let json = br#"{"id":"x","model":"llama-3-8b","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":3}}"#;
        let a = Answer::of(json);
        assert_eq!(a.model.as_deref(), Some("llama-3-8b"));
        assert_eq!(a.finish_reasons, ["length"]);

        let sse = "ta\":1}\n\ndata: {\"model\":\"m\",\"choices\":[{\"index\":1,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n\
                   data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n\
                   data: {\"model\":\"m\",\"choices\":[],\"usage\":{}}\n\ndata: [DONE]\n\n";
        let a = Answer::of(sse.as_bytes());
        assert_eq!(a.model.as_deref(), Some("m"));
        assert_eq!(a.finish_reasons, ["stop", "length"]);
        assert!(Answer::of(b"not json").model.is_none());

        // Escaped text, keys quoted inside content, a null ending, a value cut off.
        let json = br#"{"model":"m\u00e9","choices":[{"message":{"content":"say \"model\": no"},"finish_reason":null},{"finish_reason":"stop"}]}"#;
        let a = Answer::of(json);
        assert_eq!(a.model.as_deref(), Some("m\u{e9}"));
        assert_eq!(a.finish_reasons, ["stop"]);
        assert!(Answer::of(br#"{"model":"unterminated"#).model.is_none());
    }
}
