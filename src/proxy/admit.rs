//! `request_filter`: everything decided before vLLM is contacted — ops endpoints, tenant and
//! tier, body pre-read, the policy decision, the in-flight slot or queue wait. A request refused
//! here never reaches a backend.

use super::ctx::{BodyMode, Ctx};
use super::respond::{capacity_body, error_body, send_json};
use super::App;
use crate::admission::{Admission, QueueParams};
use crate::policy::{self, Action, Pool, Reason, RequestFacts};
use crate::shaping::{self, Shaped};
use bytes::BytesMut;
use pingora::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Pingora's retry buffer holds 64 KiB; a larger pre-read would lose the body (see notes §2).
pub const PREREAD_MAX: usize = 64 * 1024;

static REQUEST_SEQ: AtomicU64 = AtomicU64::new(0);

fn request_id(app: &App, session: &Session) -> String {
    let given = session
        .req_header()
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok());
    match given {
        Some(id)
            if !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            id.to_string()
        }
        _ => format!(
            "{}-{:08x}",
            app.replica,
            REQUEST_SEQ.fetch_add(1, Ordering::Relaxed)
        ),
    }
}

pub async fn request_filter(app: &App, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
    ctx.received_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    ctx.request_id = request_id(app, session);
    if crate::ops::is_ops_path(session.req_header().uri.path()) {
        ctx.ops = true;
        crate::ops::handle(app, session, ctx).await?;
        return Ok(true);
    }

    let cfg = app.config.load_full();
    let req = session.req_header();
    let method = req.method.as_str().to_string();
    let shapeable = shaping::is_shapeable(&method, req.uri.path());

    // Who is asking.
    let tenant = req.headers.get("x-tenant-id").map(|v| v.as_bytes());
    let auth = req.headers.get("authorization").map(|v| v.as_bytes());
    match app.tenants.load().resolve(tenant, auth) {
        Ok(id) => ctx.identity = Some(id),
        Err(reason) => {
            let (status, code) = match reason {
                Reason::InvalidTenantHeader => (400, "invalid_header"),
                _ => (401, "unauthorized"),
            };
            return refuse(
                session,
                ctx,
                status,
                "reject",
                reason,
                error_body("sluice_auth", code, reason, reason.describe()),
                None,
            )
            .await;
        }
    }
    let tier = ctx
        .identity
        .as_ref()
        .map_or(policy::Tier::BestEffort, |i| i.tier);

    // Body size, from the declared length; chunked uploads are counted as they stream.
    let declared = match content_length(session) {
        Ok(n) => n,
        Err(()) => {
            let body = error_body(
                "sluice_request",
                "invalid_header",
                Reason::InvalidJson,
                "Content-Length is not a number",
            );
            return refuse(session, ctx, 400, "reject", Reason::InvalidJson, body, None).await;
        }
    };
    if declared.is_some_and(|n| n > cfg.limits.max_body_bytes) {
        let msg = format!("request body exceeds {} bytes", cfg.limits.max_body_bytes);
        let body = error_body(
            "sluice_request",
            "body_too_large",
            Reason::BodyTooLarge,
            &msg,
        );
        return refuse(
            session,
            ctx,
            413,
            "reject",
            Reason::BodyTooLarge,
            body,
            None,
        )
        .await;
    }

    // Pre-read small completion bodies: the ledger wants the model and max_tokens, and a
    // rewrite then needs no chunked re-framing.
    let mut raw = None;
    if shapeable && declared.is_some_and(|n| n > 0 && n <= PREREAD_MAX) {
        session.enable_retry_buffering();
        let mut buf = BytesMut::new();
        while let Some(chunk) = session.read_request_body().await? {
            buf.extend_from_slice(&chunk);
            if buf.len() > PREREAD_MAX {
                break;
            }
        }
        if session.retry_buffer_truncated() || buf.len() > PREREAD_MAX {
            let body = error_body(
                "sluice_request",
                "body_too_large",
                Reason::BodyTooLarge,
                "body longer than its Content-Length",
            );
            return refuse(
                session,
                ctx,
                413,
                "reject",
                Reason::BodyTooLarge,
                body,
                None,
            )
            .await;
        }
        ctx.body_mode = BodyMode::Preread;
        ctx.facts = shaping::facts(&buf);
        raw = Some(buf.freeze());
    }

    // The policy decision, against the latest published state.
    app.pools.first_checks(Duration::from_secs(2)).await;
    let state = app.hub.state();
    let rules = app.hub.rules();
    let fallback = app
        .pools
        .fallbacks
        .iter()
        .position(|h| app.pools.healthy_count(h) > 0);
    let facts = RequestFacts {
        tier,
        shapeable,
        fallback_available: fallback.is_some(),
        spot_healthy: app.pools.healthy_count(&app.pools.spot) > 0,
    };
    let decision = policy::decide(&state, &rules, &facts);
    ctx.label = decision.action.name();
    ctx.reason = Some(decision.reason);
    ctx.pool = Some(decision.pool);
    ctx.route_reason = Some(decision.route_reason);
    ctx.cap = decision.action.max_tokens_cap();
    if matches!(decision.action, Action::Fallback { .. }) {
        ctx.fallback_index = fallback;
        ctx.fallback_model = fallback.and_then(|i| app.pools.fallbacks[i].model.clone());
    }
    let action = decision.action.clone();
    let queue_eligible = decision.queue_eligible;
    ctx.decision = Some(decision);

    if action == Action::Reject {
        let reason = ctx.reason.unwrap_or(Reason::RejectPressure);
        let body = capacity_body(reason, tier, &state.signals);
        let retry = (rules.stability.cooldown_ms / 1000).max(1);
        return refuse(session, ctx, 429, "reject", reason, body, Some(retry)).await;
    }

    // Shape now when the body is in hand; otherwise buffer it later if a rewrite is needed.
    let needs_rewrite = ctx.cap.is_some() || ctx.fallback_model.is_some();
    match raw {
        Some(raw) => match shaping::shape(&raw, ctx.cap, ctx.fallback_model.as_deref()) {
            Shaped::Unchanged(_) => {}
            Shaped::Rewritten {
                body,
                applied_max_tokens,
                ..
            } => {
                ctx.applied_max_tokens = applied_max_tokens;
                ctx.new_body = Some(body.into());
            }
            Shaped::NotJson if needs_rewrite => {
                let body = error_body(
                    "sluice_request",
                    "invalid_json",
                    Reason::InvalidJson,
                    "the decision needs to rewrite the body, which is not a JSON object",
                );
                return refuse(session, ctx, 400, "reject", Reason::InvalidJson, body, None).await;
            }
            Shaped::NotJson => ctx.reason = Some(Reason::BodyNotJsonForwarded),
        },
        None if shapeable && needs_rewrite && declared != Some(0) => {
            ctx.body_mode = BodyMode::Buffered
        }
        None => {}
    }
    if ctx.applied_max_tokens.is_none() && ctx.new_body.is_none() {
        ctx.applied_max_tokens = ctx.facts.as_ref().and_then(|f| f.max_tokens);
    }

    // Only completions hold capacity: model listings and health probes must not queue.
    if shapeable {
        let tier_rules = rules.tier(tier);
        let queue = queue_eligible.then(|| QueueParams {
            max_size: cfg.queue.max_size,
            max_wait: Duration::from_millis(cfg.queue.max_wait_ms()),
            poll: Duration::from_millis(cfg.queue.poll_ms()),
        });
        let mut draining = app.draining.subscribe();
        let admitted = tokio::select! {
            a = app.admission.admit(tier, tier_rules.inflight_capacity, queue) => a,
            // Dropping the admit future leaves the queue; its slot, if any, goes to the next.
            _ = draining.wait_for(|d| *d) => Admission::Refused { reason: Reason::Draining, queued_for: None },
        };
        match admitted {
            Admission::Admitted {
                slot,
                queued_for,
                fail_open,
            } => {
                ctx.slot = Some(slot);
                if fail_open {
                    ctx.reason = Some(Reason::CoordinatorFailOpen);
                }
                if let Some(q) = queued_for {
                    ctx.queued_for = Some(q);
                    ctx.label = "queue";
                    ctx.reason = Some(Reason::QueueReleased);
                    app.metrics
                        .queue_wait
                        .with_label_values(&[tier.as_str(), "released"])
                        .observe(q.as_secs_f64());
                }
            }
            Admission::Refused { reason, queued_for } => {
                ctx.queued_for = queued_for;
                if let Some(q) = queued_for {
                    app.metrics
                        .queue_wait
                        .with_label_values(&[tier.as_str(), reason.as_str()])
                        .observe(q.as_secs_f64());
                }
                if reason == Reason::Draining {
                    let body = error_body(
                        "sluice_draining",
                        "draining",
                        reason,
                        "Sluice is shutting down; retry on another replica",
                    );
                    session.set_keepalive(None);
                    return refuse(session, ctx, 503, "reject", reason, body, Some(1)).await;
                }
                let label = if queued_for.is_some() || reason == Reason::QueueDropped {
                    "queue"
                } else {
                    "reject"
                };
                let body = capacity_body(reason, tier, &state.signals);
                return refuse(session, ctx, 429, label, reason, body, Some(1)).await;
            }
        }
    }
    if ctx.pool == Some(Pool::Fallback) && ctx.fallback_index.is_none() {
        ctx.pool = Some(Pool::OnDemand);
    }
    Ok(false)
}

fn content_length(session: &Session) -> std::result::Result<Option<usize>, ()> {
    match session.req_header().headers.get("content-length") {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map(Some)
            .ok_or(()),
    }
}

/// Answers the request from Sluice itself; `retry_after_s` adds `Retry-After` (429s).
async fn refuse(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    label: &'static str,
    reason: Reason,
    body: serde_json::Value,
    retry_after_s: Option<u64>,
) -> Result<bool> {
    ctx.label = label;
    ctx.reason = Some(reason);
    ctx.pool = None;
    let extra: Vec<(&str, String)> = retry_after_s
        .map(|s| ("retry-after", s.to_string()))
        .into_iter()
        .collect();
    send_json(session, ctx, status, &body, &extra).await?;
    Ok(true)
}
