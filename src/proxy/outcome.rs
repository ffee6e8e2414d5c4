//! The outcome side: decision headers on forwarded responses, token usage from the response
//! body (plain JSON or the final SSE usage chunk), errors Sluice answers itself, and the
//! decision record with its metrics in `logging`, which runs exactly once per request.

use super::ctx::Ctx;
use super::respond::{decision_headers, error_body, send_json};
use super::App;
use crate::decisions::{DecisionRecord, SignalsUsed};
use crate::policy::Reason;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::FailToProxy;
use pingora::{ErrorSource, ErrorType};
use std::sync::Arc;
use std::time::Instant;

/// Bytes of response kept to find `usage`: a whole non-streamed completion body, or the tail of
/// a stream (the usage chunk comes right before `[DONE]`).
const USAGE_KEEP: usize = 64 * 1024;
const SSE_TAIL: usize = 8 * 1024;

pub fn response_filter(resp: &mut ResponseHeader, ctx: &mut Ctx) -> Result<()> {
    ctx.status = resp.status.as_u16();
    ctx.response_is_sse = resp
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    decision_headers(resp, ctx)
}

pub fn response_body_filter(body: &mut Option<Bytes>, _eos: bool, ctx: &mut Ctx) {
    let Some(chunk) = body.as_ref().filter(|b| !b.is_empty()) else {
        return;
    };
    if ctx.first_byte.is_none() {
        ctx.first_byte = Some(Instant::now());
    }
    if ctx.ops || ctx.identity.is_none() {
        return;
    }
    if ctx.response_is_sse {
        ctx.response_tail.extend_from_slice(chunk);
        if ctx.response_tail.len() > 2 * SSE_TAIL {
            let cut = ctx.response_tail.len() - SSE_TAIL;
            let _ = ctx.response_tail.split_to(cut);
        }
    } else if ctx.response_tail.len() + chunk.len() <= USAGE_KEEP {
        ctx.response_tail.extend_from_slice(chunk);
    }
}

/// (prompt_tokens, completion_tokens) from a completion body or an SSE stream's usage chunk.
pub fn usage_of(body: &[u8], sse: bool) -> (Option<u64>, Option<u64>) {
    // Typed, so the rest of a completion (its text above all) is skipped, not built into a tree.
    #[derive(serde::Deserialize)]
    struct Body {
        usage: Option<Usage>,
    }
    let parse = |json: &[u8]| {
        serde_json::from_slice::<Body>(json)
            .ok()?
            .usage
            .map(Usage::counts)
    };
    if !sse {
        return usage_near_end(body)
            .or_else(|| parse(body))
            .unwrap_or_default();
    }
    let text = String::from_utf8_lossy(body);
    text.rsplit("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:"))
        .map(str::trim)
        .filter(|data| data.starts_with('{') && data.contains("\"usage\""))
        .find_map(|data| parse(data.as_bytes()))
        .unwrap_or_default()
}

/// The usage object of a completion body, found by its key from the end (vLLM and OpenAI put
/// it last) and parsed alone: the whole body was ~6k instructions per request to read two
/// numbers. `"usage"` followed by `:` cannot occur inside a JSON string (its quotes would be
/// escaped there), so a match is a key; `None` sends the caller to the full parse.
fn usage_near_end(body: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    const KEY: &[u8] = b"\"usage\"";
    let at = body.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &body[at + KEY.len()..];
    let value = rest.trim_ascii_start().strip_prefix(b":")?;
    if let Some(counts) = flat_usage(value) {
        return Some(counts);
    }
    let mut de = serde_json::Deserializer::from_slice(value);
    let u = <Option<Usage> as serde::Deserialize>::deserialize(&mut de).ok()??;
    Some(u.counts())
}

/// The usage value as vLLM writes it — `null`, or one flat object of whole counts and nulls
/// (`prompt_tokens_details: null`) — read without serde (~1.6k instructions a request there).
/// `None` for any other shape (a nested object, a string, a fraction, a repeated key), which
/// the caller hands to serde.
fn flat_usage(value: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    let mut rest = value.trim_ascii_start();
    if rest.starts_with(b"null") {
        return Some((None, None));
    }
    rest = rest.strip_prefix(b"{")?.trim_ascii_start();
    let (mut prompt, mut completion) = (None, None);
    let (mut seen_prompt, mut seen_completion) = (false, false);
    if rest.starts_with(b"}") {
        return Some((None, None));
    }
    loop {
        rest = rest.strip_prefix(b"\"")?;
        let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
        if rest[end] != b'"' {
            return None;
        }
        let key = &rest[..end];
        rest = rest[end + 1..]
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        let count = if let Some(after) = rest.strip_prefix(b"null") {
            rest = after;
            None
        } else {
            let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits == 0 || digits > 19 {
                return None;
            }
            let n = std::str::from_utf8(&rest[..digits])
                .ok()?
                .parse::<u64>()
                .ok()?;
            rest = &rest[digits..];
            if matches!(rest.first(), Some(b'.' | b'e' | b'E')) {
                return None;
            }
            Some(n)
        };
        let slot = match key {
            b"prompt_tokens" => Some((&mut prompt, &mut seen_prompt)),
            b"completion_tokens" => Some((&mut completion, &mut seen_completion)),
            _ => None,
        };
        if let Some((value, seen)) = slot {
            if std::mem::replace(seen, true) {
                return None;
            }
            *value = count;
        }
        rest = rest.trim_ascii_start();
        match rest.first()? {
            b',' => rest = rest[1..].trim_ascii_start(),
            b'}' => return Some((prompt, completion)),
            _ => return None,
        }
    }
}

#[derive(serde::Deserialize)]
struct Usage {
    prompt_tokens: Option<serde_json::Value>,
    completion_tokens: Option<serde_json::Value>,
}

impl Usage {
    fn counts(self) -> (Option<u64>, Option<u64>) {
        let count = |v: Option<serde_json::Value>| v.and_then(|v| v.as_u64());
        (count(self.prompt_tokens), count(self.completion_tokens))
    }
}

/// The completions endpoints borrowed (no allocation per record), any other path copied.
fn path_text(path: &str) -> crate::decisions::Text {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions".into(),
        "/v1/completions" => "/v1/completions".into(),
        p => p.to_string().into(),
    }
}

/// The standard methods as static names (no allocation per record), others as sent.
fn method_name(m: &http::Method) -> crate::decisions::Text {
    match m.as_str() {
        "GET" => "GET".into(),
        "POST" => "POST".into(),
        "PUT" => "PUT".into(),
        "PATCH" => "PATCH".into(),
        "DELETE" => "DELETE".into(),
        "HEAD" => "HEAD".into(),
        "OPTIONS" => "OPTIONS".into(),
        other => other.to_string().into(),
    }
}

fn error_kind(e: &Error) -> &'static str {
    match (e.esource(), e.etype()) {
        (_, ErrorType::HTTPStatus(_)) => "refused",
        (ErrorSource::Downstream, _) => "client_gone",
        (
            _,
            ErrorType::ConnectTimedout
            | ErrorType::ConnectRefused
            | ErrorType::ConnectNoRoute
            | ErrorType::ConnectError,
        ) => "connect_error",
        (_, ErrorType::ReadTimedout | ErrorType::WriteTimedout) => "upstream_timeout",
        (ErrorSource::Upstream, _) => "upstream_error",
        _ => "internal_error",
    }
}

pub async fn fail_to_proxy(
    app: &App,
    session: &mut Session,
    e: &Error,
    ctx: &mut Ctx,
) -> FailToProxy {
    let kind = error_kind(e);
    ctx.error = Some(kind.to_string());
    let code = match e.etype() {
        ErrorType::HTTPStatus(c) => *c,
        _ => match kind {
            "client_gone" => 0,
            "upstream_timeout" => 504,
            "internal_error" => 500,
            _ => 502,
        },
    };
    if matches!(kind, "upstream_error" | "upstream_timeout") {
        let pool = ctx.pool.map_or("unknown", |p| p.as_str());
        app.metrics
            .upstream_errors
            .with_label_values(&[pool, kind])
            .inc();
    }
    // Once the response has started (a stream cut mid-way), an error body would corrupt it.
    if code == 0 || session.response_written().is_some() {
        if let Some(resp) = session.response_written() {
            ctx.status = resp.status.as_u16();
        }
        return FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        };
    }
    // The client gets a fixed message per status: `e` carries Pingora's context chain, which
    // names backend addresses. The detail goes to the log line instead.
    log::warn!(
        target: "sluice::proxy",
        "{}",
        serde_json::json!({"event": "request_failed", "request_id": ctx.request_id,
                           "status": code, "kind": kind, "detail": e.to_string()})
    );
    let (reason, body) = match code {
        503 => (
            Reason::BackendUnavailable,
            error_body(
                "sluice_backend",
                "backend_unavailable",
                Reason::BackendUnavailable,
                "No healthy backend is available for this request.",
            ),
        ),
        413 => (
            Reason::BodyTooLarge,
            error_body(
                "sluice_request",
                "body_too_large",
                Reason::BodyTooLarge,
                &format!(
                    "The request body exceeds {} bytes.",
                    app.config.load().limits.max_body_bytes
                ),
            ),
        ),
        400 => (
            Reason::InvalidJson,
            error_body(
                "sluice_request",
                "invalid_json",
                Reason::InvalidJson,
                "The decision needs to rewrite the body, which is not a JSON object.",
            ),
        ),
        _ => (
            Reason::UpstreamError,
            error_body(
                "sluice_backend",
                "upstream_error",
                Reason::UpstreamError,
                match kind {
                    "upstream_timeout" => "The backend timed out before answering.",
                    "internal_error" => "Sluice failed to proxy the request.",
                    _ => "The backend failed before answering.",
                },
            ),
        ),
    };
    ctx.reason = Some(reason);
    ctx.label = "error";
    if send_json(session, ctx, code, &body, &[]).await.is_err() {
        ctx.error = Some("client_gone".into());
    }
    FailToProxy {
        error_code: code,
        can_reuse_downstream: false,
    }
}

/// A duration in milliseconds, to the microsecond. `as_secs_f64() * 1000.0` keeps float noise
/// that the shortest round-trip form then prints in full (`0.07178699999999999`): ~15 bytes of
/// every duration in every log line, `/decisions/recent` answer and export, and no reader
/// wants digits below a microsecond. A whole number of microseconds divided by 1000 prints as
/// written (`0.072`).
fn millis(d: std::time::Duration) -> f64 {
    ((d.as_nanos() + 500) / 1000) as f64 / 1000.0
}

/// A duration in microseconds, to the nanosecond (see [`millis`]).
fn micros(d: std::time::Duration) -> f64 {
    d.as_nanos() as f64 / 1000.0
}

fn queue_outcome(ctx: &Ctx) -> Option<&'static str> {
    match ctx.reason {
        Some(r @ (Reason::QueueReleased | Reason::QueueTimedOut | Reason::QueueDropped)) => {
            Some(r.as_str())
        }
        _ if ctx.queued_for.is_some() => Some(Reason::QueueReleased.as_str()),
        _ => None,
    }
}

pub fn logging(app: &App, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
    if ctx.ops {
        return;
    }
    if let Some(resp) = session.response_written() {
        ctx.status = resp.status.as_u16();
    }
    if let Some(e) = e {
        if ctx.error.is_none() {
            ctx.error = Some(error_kind(e).to_string());
        }
    }
    let started = ctx.started.unwrap_or_else(Instant::now);
    let latency = started.elapsed();
    let ttfb = ctx.first_byte.map(|t| t.duration_since(started));
    let (prompt_tokens, completion_tokens) = usage_of(&ctx.response_tail, ctx.response_is_sse);
    let tier = ctx.identity.as_ref().map(|i| i.tier);
    let tier_name = tier.map_or("unknown", |t| t.as_str());
    let rules = app.hub.rules();
    let sla_target = tier.map(|t| rules.tier(t).sla_target_ms);
    let proxied = ctx.backend.is_some();
    let sla_violated = sla_target
        .filter(|_| proxied && ctx.error.is_none())
        .map(|t| latency.as_millis() as u64 > t);
    let label = if ctx.label.is_empty() {
        "pass"
    } else {
        ctx.label
    };
    let reason = ctx.reason.map_or("", Reason::as_str);
    // The signals of the sample the decision read, not of the one in force now.
    let signals = ctx.inputs.map(|i| i.pools[0].signals()).unwrap_or_default();
    let req = session.req_header();
    let record = DecisionRecord {
        request_id: std::mem::take(&mut ctx.request_id),
        received_at_ms: ctx.received_at_ms,
        replica: app.replica.into(),
        // Taken, not cloned (one allocation each per request): nothing reads them after this.
        tenant: ctx
            .identity
            .as_mut()
            .map(|i| std::mem::take(&mut i.tenant))
            .unwrap_or_default(),
        tier: tier_name.into(),
        method: method_name(&req.method),
        path: path_text(req.uri.path()),
        decision: label.into(),
        reason: reason.into(),
        state: ctx
            .decision
            .as_ref()
            .map_or("", |d| d.state.as_str())
            .into(),
        pool: ctx.pool.filter(|_| proxied).map(|p| p.as_str().into()),
        route_reason: ctx
            .route_reason
            .filter(|_| proxied)
            .map(|r| r.as_str().into()),
        backend: ctx.backend.take(),
        routed_model: ctx
            .fallback_model
            .take()
            .or_else(|| ctx.facts.as_ref().and_then(|f| f.model.clone())),
        requested_model: ctx.facts.as_mut().and_then(|f| f.model.take()),
        requested_max_tokens: ctx.facts.as_ref().and_then(|f| f.max_tokens),
        applied_max_tokens: ctx.applied_max_tokens,
        stream: ctx.facts.as_ref().is_some_and(|f| f.stream),
        queue_wait_ms: ctx.queued_for.map(millis),
        status: ctx.status,
        latency_ms: millis(latency),
        ttfb_ms: ttfb.map(millis),
        overhead_us: ctx.overhead.map(micros),
        prompt_tokens,
        completion_tokens,
        sla_target_ms: sla_target,
        sla_violated,
        signals: SignalsUsed {
            pressure: signals.pressure,
            queue_depth: signals.queue_depth,
            sla_violation_rate: signals.sla_violation_rate,
        },
        error: ctx.error.clone(),
        queue_outcome: queue_outcome(ctx).map(str::to_string),
        inputs: ctx.inputs,
    };
    feed_controller(app, ctx, latency, proxied);
    if let Some(ticket) = &ctx.quota {
        app.quotas
            .settle(&record.tenant, ticket, proxied, completion_tokens);
    }
    let m = &app.metrics;
    let secs = |d: Option<std::time::Duration>| d.filter(|_| proxied).map(|d| d.as_secs_f64());
    let observed = crate::metrics::RequestObservations {
        duration: secs(Some(latency)),
        ttfb: secs(ttfb),
        overhead: secs(ctx.overhead),
        sla_violated: record.sla_violated,
    };
    m.record_request(tier_name, label, reason, observed);
    let cfg = app.config.load();
    let metrics_cfg = &cfg.metrics;
    if metrics_cfg.tenant_label {
        let tenant = m.tenant_label(&record.tenant, metrics_cfg.max_tenants);
        m.tenant_requests
            .with_label_values(&[tenant.as_str(), tier_name, label])
            .inc();
        let served = record.prompt_tokens.unwrap_or(0) + record.completion_tokens.unwrap_or(0);
        if served > 0 {
            m.tenant_tokens
                .with_label_values(&[tenant.as_str(), tier_name])
                .inc_by(served);
        }
    }
    let log_line = wants_log_line(&cfg, &record)
        && log::log_enabled!(target: "sluice::request", log::Level::Info);
    let record = Arc::new(record);
    // Straight to the log writer, which encodes the line off the request path; env_logger's
    // formatter would copy it twice and scan every byte for colour codes.
    if let Some(w) = log_line.then(crate::log_writer::stderr).flatten() {
        // Written once, where the durable record is: with a ledger the inputs go there only.
        let with_inputs = cfg
            .decisions
            .log_inputs
            .unwrap_or(cfg.database_url.is_none());
        w.write_decision(Arc::clone(&record), with_inputs);
    }
    for sink in &app.sinks {
        sink.record(Arc::clone(&record));
    }
    app.decisions.push(record);
}

/// Whether `decisions.log_requests` keeps this record's log line.
fn wants_log_line(cfg: &crate::config::Config, record: &DecisionRecord) -> bool {
    use crate::config::LogRequests;
    match cfg
        .decisions
        .log_requests
        .resolve(cfg.database_url.is_some())
    {
        LogRequests::All | LogRequests::Auto => true,
        LogRequests::Off => false,
        LogRequests::Exceptions => is_exception(record),
    }
}

/// A request an operator reading the log looks for: not plainly served.
fn is_exception(record: &DecisionRecord) -> bool {
    &*record.decision != "pass"
        || record.status >= 400
        || record.error.is_some()
        || record.sla_violated == Some(true)
}

/// The adaptive controller that judges this request: the decision's pool, a fallback's being
/// the pool whose backend runs it (none when the fallback has backends of its own).
pub(super) fn controller_pool(app: &App, ctx: &Ctx) -> Option<usize> {
    let d = ctx.decision.as_ref()?;
    let pool = match d.pool {
        crate::policy::Pool::Fallback => ctx
            .fallback_index
            .and_then(|i| app.pools.fallbacks.get(i))
            .and_then(|h| h.runs_on)?,
        p => p,
    };
    pool.signal_index()
}

/// The end of a proxied request for the adaptive controller (its arrival was reported when it
/// was decided): the latency when served, a missed target when the backend failed.
fn feed_controller(app: &App, ctx: &Ctx, latency: std::time::Duration, proxied: bool) {
    let (Some(d), Some(index)) = (ctx.decision.as_ref(), controller_pool(app, ctx)) else {
        return;
    };
    let failed = matches!(
        ctx.error.as_deref(),
        Some("upstream_error" | "upstream_timeout" | "connect_error")
    );
    if !proxied || !(failed || ctx.error.is_none()) {
        return;
    }
    use crate::policy::adaptive::Outcome;
    let at = app.hub.clock().now_ms();
    let outcome = if failed {
        Outcome::failed(at, d.tier)
    } else {
        Outcome::served(at, d.tier, latency.as_secs_f64() * 1000.0)
    };
    app.hub.record_outcome(index, outcome);
}

#[cfg(test)]
mod tests {
    use super::{micros, millis, usage_of};
    use std::time::Duration;

    #[test]
    fn durations_print_to_the_microsecond() {
        let json = |v: f64| serde_json::to_string(&v).unwrap();
        assert_eq!(json(millis(Duration::from_nanos(71_787))), "0.072");
        assert_eq!(json(millis(Duration::from_nanos(321_400_000))), "321.4");
        assert_eq!(json(millis(Duration::from_secs(2))), "2000.0");
        assert_eq!(json(micros(Duration::from_nanos(1_763))), "1.763");
    }

    #[test]
    fn usage_from_json_and_sse() {
        let body =
            br#"{"id":"x","usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        assert_eq!(usage_of(body, false), (Some(5), Some(7)));
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_of(sse, true), (Some(3), Some(9)));
        assert_eq!(
            usage_of(b"data: {\"usage\":null}\n\ndata: [DONE]\n\n", true),
            (None, None)
        );
        assert_eq!(usage_of(b"not json", false), (None, None));
        // The key inside generated text is escaped, so only the real usage counts.
        let body = br#"{"choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\": 99}"}}],"usage" : {"prompt_tokens":4,"completion_tokens":2}}"#;
        assert_eq!(usage_of(body, false), (Some(4), Some(2)));
        assert_eq!(
            usage_of(br#"{"usage":null,"choices":[]}"#, false),
            (None, None)
        );
        // Not last: found all the same; a body cut mid-usage falls back and finds nothing.
        assert_eq!(
            usage_of(
                br#"{"usage":{"prompt_tokens":1,"completion_tokens":3},"id":"x"}"#,
                false
            ),
            (Some(1), Some(3))
        );
        assert_eq!(usage_of(br#"{"usage":{"prompt_tok"#, false), (None, None));
    }

    /// The flat reader and serde agree on every shape either reads; what the flat one declines
    /// serde still reads.
    #[test]
    fn flat_usage_agrees_with_serde() {
        let serde_read = |v: &[u8]| {
            let u: Option<super::Usage> = serde_json::from_slice(v).ok()?;
            Some(u.map_or((None, None), super::Usage::counts))
        };
        for v in [
            &br#"null"#[..],
            br#"{}"#,
            br#"{"prompt_tokens":5,"total_tokens":12,"completion_tokens":7}"#,
            br#" { "prompt_tokens" : 5 , "completion_tokens" : null , "prompt_tokens_details" : null } "#,
            br#"{"completion_tokens":18446744073709551615}"#,
            br#"{"prompt_tokens":1.5,"completion_tokens":2}"#,
            br#"{"prompt_tokens":-1,"completion_tokens":2}"#,
            br#"{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2},"completion_tokens":4}"#,
            br#"{"prompt_tokens":"3","completion_tokens":4}"#,
            br#"{"prompt_tokens":3,"prompt_tokens":4}"#,
            br#"{"prompt_tokens":3,"completion_tokens":4"#,
            br#"{"pro\"mpt_tokens":3}"#,
            br#"{"prompt_tokens":1e3}"#,
        ] {
            if let Some(flat) = super::flat_usage(v) {
                assert_eq!(Some(flat), serde_read(v), "{}", String::from_utf8_lossy(v));
            }
        }
        assert!(super::flat_usage(br#"{"prompt_tokens":3,"completion_tokens":4}"#).is_some());
        let nested = br#"{"prompt_tokens_details":{"cached_tokens":2},"prompt_tokens":3,"completion_tokens":4}"#;
        assert_eq!(super::flat_usage(nested), None);
        let body = [&br#"{"usage":"#[..], nested, b"}"].concat();
        assert_eq!(usage_of(&body, false), (Some(3), Some(4)));
    }
}
