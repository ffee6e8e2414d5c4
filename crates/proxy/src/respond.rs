//! Responses Sluice writes itself: the JSON error bodies of the API contract, with the
//! `x-sluice-*` headers, written so the client connection stays keep-alive.

use super::ctx::Ctx;
use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use serde_json::json;
use sluice_policy::{PoolSignals, Reason, Tier};
use std::time::Duration;

/// The rejection body (the seed's shape).
pub fn capacity_body(reason: Reason, tier: Tier, s: &PoolSignals) -> serde_json::Value {
    json!({"error": {
        "type": "sluice_capacity",
        "code": "capacity_rejected",
        "message": format!("{} request rejected by Sluice: {}", tier, reason.describe()),
        "reason": reason.as_str(),
        "tier": tier.as_str(),
        "pressure": s.pressure,
        "queue_depth": s.queue_depth,
        "sla_violation_rate": s.sla_violation_rate,
    }})
}

pub fn error_body(kind: &str, code: &str, reason: Reason, message: &str) -> serde_json::Value {
    json!({"error": {"type": kind, "code": code, "reason": reason.as_str(), "message": message}})
}

/// The request id as a header value, for the response and the upstream request.
pub fn request_id_value(ctx: &Ctx) -> Result<HeaderValue> {
    HeaderValue::from_str(&ctx.request_id)
        .or_err(pingora::ErrorType::InvalidHTTPHeader, "request id")
}

/// The most headers [`decision_headers`] adds (request id, decision, reason, tier, pool, queue
/// wait, a denied retry), quota headers aside.
pub const DECISION_HEADERS: usize = 7;

/// Sets the decision headers on any response Sluice forwards or makes.
pub fn decision_headers(resp: &mut ResponseHeader, ctx: &Ctx) -> Result<()> {
    // Header names go out in canonical case (standard ones title-cased, others lowercase), as
    // Envoy writes HTTP/1: each insert below then touches one map instead of two, and names are
    // case-insensitive to every client (HTTP/2 has only lowercase ones).
    resp.drop_header_case();
    // Named statically (no parse or copy of each name: ~4k instructions a response through
    // `insert_header`), and room made once for all of them (already there in a proxied
    // response: `upstream::upstream_peer` asks Pingora for it).
    resp.reserve_headers(DECISION_HEADERS);
    if !ctx.request_id.is_empty() {
        resp.insert_header_static("x-request-id", request_id_value(ctx)?);
    }
    // Static values need no copy or validation per response.
    let fixed = HeaderValue::from_static;
    if let Some(label) = ctx.label {
        resp.insert_header_static("x-sluice-decision", fixed(label.as_str()));
    }
    if let Some(r) = ctx.reason {
        resp.insert_header_static("x-sluice-reason", fixed(r.as_str()));
    }
    if let Some(id) = &ctx.identity {
        resp.insert_header_static("x-sluice-tier", fixed(id.tier.as_str()));
    }
    for (name, value) in ctx.quota.iter().flat_map(|q| q.headers()) {
        resp.insert_header(name, value)?;
    }
    if let (Some(pool), Some(_)) = (ctx.pool_label, &ctx.backend) {
        resp.insert_header_static("x-sluice-pool", fixed(pool));
    }
    if let Some(why) = ctx.retry_denied {
        resp.insert_header_static("x-sluice-retry-denied", fixed(why.as_str()));
    }
    if let Some(q) = ctx.queued_for {
        let wait = HeaderValue::from_str(&format!("{:.1}", q.as_secs_f64() * 1000.0))
            .or_err(pingora::ErrorType::InvalidHTTPHeader, "queue wait")?;
        resp.insert_header_static("x-sluice-queue-wait-ms", wait);
    }
    Ok(())
}

/// Writes a complete response. A body the refusal left unread is then read and discarded
/// (bounded by `ctx.refused_body_drain`), as nginx's lingering close does: closing with unread
/// bytes makes the kernel reset the connection, and a client still sending its body (Python's
/// http.client, httpx, the openai SDK) would see `Broken pipe` instead of this answer. A body
/// drained whole leaves the connection reusable; a larger or slower one is cut after the bound.
pub async fn send(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    content_type: &str,
    body: Bytes,
    extra: &[(&str, String)],
) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(6))?;
    resp.insert_header("content-type", content_type)?;
    resp.insert_header("content-length", body.len().to_string())?;
    resp.insert_header("cache-control", "no-store")?;
    for (k, v) in extra {
        resp.insert_header(k.to_string(), v.as_str())?;
    }
    decision_headers(&mut resp, ctx)?;
    let unread = !session.is_body_done();
    let (drain_max, drain_time) = ctx.refused_body_drain;
    // Announce the close up front when the body cannot be drained within the bound.
    let declared = session
        .req_header()
        .headers
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    if unread && declared.is_none_or(|n| n > drain_max as u64) {
        session.set_keepalive(None);
    }
    if ctx.closing {
        session.set_keepalive(None);
    }
    ctx.status = status;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await?;
    if unread && !drain_unread_body(session, drain_max, drain_time).await {
        session.set_keepalive(None);
    }
    Ok(())
}

/// `true` when the request body was read to its end within the bounds.
async fn drain_unread_body(session: &mut Session, max: usize, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = 0usize;
    while !session.is_body_done() {
        match tokio::time::timeout_at(deadline, session.read_request_body()).await {
            Ok(Ok(Some(chunk))) => {
                seen += chunk.len();
                if seen > max {
                    return false;
                }
            }
            Ok(Ok(None)) => break,
            _ => return false,
        }
    }
    true
}

pub async fn send_json(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    value: &serde_json::Value,
    extra: &[(&str, String)],
) -> Result<()> {
    let body = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
    send(session, ctx, status, "application/json", body, extra).await
}
