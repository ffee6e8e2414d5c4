//! The outcome side: decision headers on forwarded responses, token usage from the response
//! body (plain JSON or the final SSE usage chunk), errors Sluice answers itself, and the
//! decision record with its metrics in `logging`, which runs exactly once per request.

use super::ctx::Ctx;
use super::respond::{decision_headers, error_body, send_json};
use super::ProxyState;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::FailToProxy;
use pingora::{ErrorSource, ErrorType};
use sluice_policy::Reason;
use sluice_record::decision::{DecisionRecord, SignalsUsed};
use sluice_record::{Failure, QueueOutcome, Verdict};
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
    if ctx.response_is_sse {
        if let Some(w) = &ctx.work {
            w.streaming();
        }
    }
    decision_headers(resp, ctx)
}

pub fn response_body_filter(app: &ProxyState, body: &mut Option<Bytes>, _eos: bool, ctx: &mut Ctx) {
    let Some(chunk) = body.as_ref().filter(|b| !b.is_empty()) else {
        return;
    };
    let now = Instant::now();
    ctx.last_byte = Some(now);
    if ctx.first_byte.is_none() {
        ctx.first_byte = Some(now);
        // The backend's answer started: replica choice learns how long it takes to.
        if let Some(lease) = ctx.lease.as_mut() {
            lease.first_byte();
        }
        // A stream's first token is the controller's news now, not when a long answer ends;
        // and its age no longer bounds it.
        if let (true, Some(started)) = (ctx.response_is_sse, ctx.started) {
            let ttft_ms = now.duration_since(started).as_secs_f64() * 1000.0;
            if let Some(w) = &ctx.work {
                w.first_token(ttft_ms);
            }
            if let (Some(d), Some(pool)) = (ctx.decision.as_ref(), controller_pool(ctx)) {
                let at = app.hub.clock().now_ms();
                let first = sluice_policy::adaptive::Outcome::first_token(at, d.tier, ttft_ms);
                app.hub.record_outcome(pool, first);
            }
        }
    }
    if ctx.identity.is_none() {
        return;
    }
    if ctx.response_is_sse {
        ctx.sse_events += memchr::memmem::find_iter(chunk, b"data:").count() as u32;
        ctx.response_tail.extend_from_slice(chunk);
        if ctx.response_tail.len() > 2 * SSE_TAIL {
            let cut = ctx.response_tail.len() - SSE_TAIL;
            let _ = ctx.response_tail.split_to(cut);
        }
    } else if ctx.response_tail.len() + chunk.len() <= USAGE_KEEP {
        ctx.response_tail.extend_from_slice(chunk);
    }
}

fn req_path_is_chat(session: &Session) -> bool {
    session.req_header().uri.path() == "/v1/chat/completions"
}

/// The completions endpoints borrowed (no allocation per record), any other path copied.
fn path_text(path: &str) -> sluice_record::decision::Text {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions".into(),
        "/v1/completions" => "/v1/completions".into(),
        p => p.to_string().into(),
    }
}

/// The standard methods as static names (no allocation per record), others as sent.
fn method_name(m: &http::Method) -> sluice_record::decision::Text {
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

fn error_kind(e: &Error) -> Failure {
    match (e.esource(), e.etype()) {
        (_, ErrorType::HTTPStatus(_)) => Failure::Refused,
        (ErrorSource::Downstream, _) => Failure::ClientGone,
        (
            _,
            ErrorType::ConnectTimedout
            | ErrorType::ConnectRefused
            | ErrorType::ConnectNoRoute
            | ErrorType::ConnectError,
        ) => Failure::ConnectError,
        (_, ErrorType::ReadTimedout | ErrorType::WriteTimedout) => Failure::UpstreamTimeout,
        (ErrorSource::Upstream, _) => Failure::UpstreamError,
        _ => Failure::InternalError,
    }
}

pub async fn fail_to_proxy(
    app: &ProxyState,
    session: &mut Session,
    e: &Error,
    ctx: &mut Ctx,
) -> FailToProxy {
    let kind = error_kind(e);
    ctx.error = Some(kind);
    let code = match e.etype() {
        ErrorType::HTTPStatus(c) => *c,
        _ => match kind {
            Failure::ClientGone => 0,
            Failure::UpstreamTimeout => 504,
            Failure::InternalError => 500,
            _ => 502,
        },
    };
    if matches!(kind, Failure::UpstreamError | Failure::UpstreamTimeout) {
        let pool = ctx
            .pool
            .and_then(|i| app.pools.get(i))
            .map_or("unknown", |h| h.label);
        app.metrics
            .upstream_errors
            .with_label_values(&[pool, kind.as_str()])
            .inc();
    }
    // Once the response has started (a stream cut mid-way), an error body would corrupt it. A
    // `100 Continue` Sluice sent for the body is no start: the error still gets its answer.
    if code == 0 || !super::failover::nothing_sent(session) {
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
                           "status": code, "kind": kind, "detail": e.to_string(),
                           "attempts": ctx.attempts, "tried": &ctx.tried})
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
                    Failure::UpstreamTimeout => "The backend timed out before answering.",
                    Failure::InternalError => "Sluice failed to proxy the request.",
                    _ => "The backend failed before answering.",
                },
            ),
        ),
    };
    ctx.reason = Some(reason);
    ctx.label = Some(Verdict::Error);
    if send_json(session, ctx, code, &body, &[]).await.is_err() {
        ctx.error = Some(Failure::ClientGone);
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

fn queue_outcome(ctx: &Ctx) -> Option<QueueOutcome> {
    match ctx.reason {
        Some(Reason::QueueReleased) => Some(QueueOutcome::Released),
        Some(Reason::QueueTimedOut) => Some(QueueOutcome::TimedOut),
        Some(Reason::QueueDropped) => Some(QueueOutcome::Dropped),
        _ if ctx.queued_for.is_some() => Some(QueueOutcome::Released),
        _ => None,
    }
}

pub fn logging(app: &ProxyState, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
    if let Some(resp) = session.response_written() {
        ctx.status = resp.status.as_u16();
    }
    if let Some(e) = e {
        if ctx.error.is_none() {
            ctx.error = Some(error_kind(e));
        }
    }
    let started = ctx.started.unwrap_or_else(Instant::now);
    let latency = started.elapsed();
    let ttfb = ctx.first_byte.map(|t| t.duration_since(started));
    let (prompt_tokens, completion_tokens) =
        sluice_record::usage::usage_of(&ctx.response_tail, ctx.response_is_sse);
    if let Some(t) = ctx.affinity.take() {
        let ok = ctx.status == 200 && ctx.error.is_none();
        t.answered(ok, &ctx.response_tail, prompt_tokens, ctx.prompt_tokens);
    }
    let tier = ctx.identity.as_ref().map(|i| i.tier);
    let tier_name = tier.map_or("unknown", |t| t.as_str());
    let rules = app.hub.rules();
    let sla_target = tier.and_then(|t| rules.tier(t).slo.e2e_ms);
    let proxied = ctx.backend.is_some();
    // A streamed answer's first token is its first body byte (vLLM sends the role chunk with
    // it) and its last token about its last chunk (the usage chunk and `[DONE]` follow at once).
    let stream = ctx.response_is_sse;
    let ttft = ttfb.filter(|_| stream).map(millis);
    // Without `stream_options.include_usage` a stream reports no usage: vLLM sends a token an
    // event, after a chat stream's role event and before `[DONE]`.
    let events = || {
        let framing = if req_path_is_chat(session) { 2 } else { 1 };
        Some(u64::from(ctx.sse_events.saturating_sub(framing))).filter(|n| *n > 0)
    };
    let streamed_tokens = completion_tokens.or_else(|| events().filter(|_| stream));
    let tpot = match (ctx.first_byte, ctx.last_byte, streamed_tokens) {
        (Some(f), Some(l), Some(n)) if stream => {
            let span = l.duration_since(f).as_secs_f64() * 1000.0;
            sluice_policy::slo::Measured::tpot_of(0.0, span, n)
        }
        _ => None,
    };
    let measured = sluice_policy::slo::Measured {
        latency_ms: latency.as_secs_f64() * 1000.0,
        ttft_ms: ttft,
        tpot_ms: tpot,
        completion_tokens,
        stream,
    };
    let judged = sluice_policy::slo::judge(&ctx.slo, &measured);
    let judged = Some(judged).filter(|j| proxied && ctx.error.is_none() && j.judged);
    let sla_violated = judged.map(|j| !j.met());
    let label = ctx.label.unwrap_or(Verdict::Pass);
    let reason = ctx.reason.map_or("", Reason::as_str);
    // The signals of the sample the decision read, not of the one in force now.
    let signals = ctx.inputs.map(|i| i.pools[0].signals()).unwrap_or_default();
    let req = session.req_header();
    let mut record = DecisionRecord {
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
        decision: label,
        reason: reason.into(),
        state: ctx
            .decision
            .as_ref()
            .map_or("", |d| d.state.as_str())
            .into(),
        pool: ctx
            .pool
            .filter(|_| proxied)
            .and_then(|i| app.pools.get(i))
            .map(|h| h.label.into()),
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
        ttft_ms: ttft,
        tpot_ms: tpot.map(|v| (v * 1000.0).round() / 1000.0),
        ttft_target_ms: ctx.slo.ttft_ms,
        tpot_target_ms: ctx.slo.tpot_ms,
        slo_missed: judged.and_then(|j| j.missed_label()).map(Into::into),
        attempts: Some(u64::from(ctx.attempts)).filter(|n| *n > 0),
        tried: (!ctx.tried.is_empty()).then(|| {
            let names: Vec<&str> = ctx.tried.iter().map(|b| &**b).collect();
            names.join(",").into()
        }),
        trace_id: None,
        signals: SignalsUsed {
            pressure: signals.pressure,
            queue_depth: signals.queue_depth,
            sla_violation_rate: signals.sla_violation_rate,
        },
        error: ctx.error,
        queue_outcome: queue_outcome(ctx),
        inputs: ctx.inputs,
    };
    record.trace_id = crate::spans::finish(app, ctx, &record, e);
    feed_controller(app, ctx, &measured, proxied);
    if let Some(ticket) = &ctx.quota {
        app.quotas
            .settle(&record.tenant, ticket, proxied, completion_tokens);
    }
    let m = &app.metrics;
    let secs = |d: Option<std::time::Duration>| d.filter(|_| proxied).map(|d| d.as_secs_f64());
    let observed = sluice_runtime::metrics::RequestObservations {
        duration: secs(Some(latency)),
        ttfb: secs(ttfb),
        overhead: secs(ctx.overhead),
        sla_violated: record.sla_violated,
    };
    m.record_request(tier_name, label.as_str(), reason, observed);
    if proxied && ctx.error.is_none() {
        m.record_slo(sluice_runtime::metrics::SloObservations {
            tier: tier_name,
            pool: record.pool.as_deref().unwrap_or("unknown"),
            ttft: ttft.map(|v| v / 1000.0),
            tpot: tpot.map(|v| v / 1000.0),
            missed: judged.map_or([false; 3], |j| j.missed),
        });
    }
    let cfg = app.config.load();
    let metrics_cfg = &cfg.metrics;
    if metrics_cfg.tenant_label {
        let tenant = m.tenant_label(&record.tenant, metrics_cfg.max_tenants);
        m.tenant_requests
            .with_label_values(&[tenant.as_str(), tier_name, label.as_str()])
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
    if let Some(w) = log_line.then(sluice_runtime::log_writer::stderr).flatten() {
        // Written once, where the durable record is: with a ledger the inputs go there only.
        let with_inputs = cfg
            .decisions
            .log_inputs
            .unwrap_or(cfg.database_url.is_none());
        w.write_decision(Arc::clone(&record), with_inputs);
    }
    for sink in app.sinks.iter() {
        sink.record(Arc::clone(&record));
    }
    app.decisions.push(record);
}

/// Whether `decisions.log_requests` keeps this record's log line.
fn wants_log_line(cfg: &sluice_config::Config, record: &DecisionRecord) -> bool {
    use sluice_config::LogRequests;
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
    record.decision != Verdict::Pass
        || record.status >= 400
        || record.error.is_some()
        || record.sla_violated == Some(true)
}

/// The adaptive controller that judges this request: its pool's (a fallback's is the pool
/// serving the fallback model).
pub(super) fn controller_pool(ctx: &Ctx) -> Option<usize> {
    ctx.decision.as_ref().and(ctx.pool)
}

/// The end of a proxied request for the adaptive controller (its arrival was reported when it
/// was decided): the latency when served, a missed target when the backend failed.
fn feed_controller(
    app: &ProxyState,
    ctx: &Ctx,
    measured: &sluice_policy::slo::Measured,
    proxied: bool,
) {
    let (Some(d), Some(index)) = (ctx.decision.as_ref(), controller_pool(ctx)) else {
        return;
    };
    let failed = matches!(
        ctx.error,
        Some(Failure::UpstreamError | Failure::UpstreamTimeout | Failure::ConnectError)
    );
    if !proxied || !(failed || ctx.error.is_none()) {
        return;
    }
    use sluice_policy::adaptive::Outcome;
    let at = app.hub.clock().now_ms();
    let outcome = if failed {
        Outcome::failed(at, d.tier)
    } else {
        let served = Outcome::served(at, d.tier, measured.latency_ms)
            .with_tokens(measured.completion_tokens);
        if measured.stream {
            // Its first token was reported when it came.
            served.streamed(None, measured.tpot_ms)
        } else {
            served
        }
    };
    app.hub.record_outcome(index, outcome);
}

#[cfg(test)]
mod tests {
    use super::{micros, millis};
    use std::time::Duration;

    #[test]
    fn durations_print_to_the_microsecond() {
        let json = |v: f64| serde_json::to_string(&v).unwrap();
        assert_eq!(json(millis(Duration::from_nanos(71_787))), "0.072");
        assert_eq!(json(millis(Duration::from_nanos(321_400_000))), "321.4");
        assert_eq!(json(millis(Duration::from_secs(2))), "2000.0");
        assert_eq!(json(micros(Duration::from_nanos(1_763))), "1.763");
    }
}
