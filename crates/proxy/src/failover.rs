//! Failover before the first byte: a request whose upstream attempt failed before any byte of
//! its response reached the client is sent again, under the same admission slot and decision,
//! to a replica it has not tried — of its pool, then of another pool of that pool's class
//! serving its model — at most `pools.<name>.retries` times and within the pool's retry budget.
//! What counts as failed: the connection refused or timed out (`fail_to_connect`), reset or
//! closed before the response head (`error_while_proxy`), and a 502, 503 or 504 answer, turned
//! into an error in `upstream_response_filter` before Pingora writes anything downstream
//! (`error_while_proxy` then retries it). Every failure also counts against its replica for
//! passive ejection, a stream cut mid-answer included (which is never retried). Slowness (a read
//! timeout) is neither.
//!
//! Pingora retries by calling `upstream_peer` again, which picks among the replicas not in
//! `ctx.tried`, and `request_body_filter` again, which sends Sluice's own copy of the body.

use super::ctx::{BodyMode, Ctx};
use super::ProxyState;
use pingora::prelude::*;
use pingora::{ErrorSource, ErrorType};
use sluice_runtime::pools::{FailureCause, PoolHandle, RetryDenied};
use std::time::Instant;

/// Nothing of the response has reached the client: no header written but a `100 Continue`.
pub fn nothing_sent(session: &Session) -> bool {
    session
        .response_written()
        .is_none_or(|r| r.status.is_informational())
}

/// The model the request is routed by now (the fallback's when moved there).
fn model(ctx: &Ctx) -> Option<&str> {
    ctx.fallback_model
        .as_deref()
        .or_else(|| ctx.facts.as_ref().and_then(|f| f.model.as_deref()))
}

/// The pools a retry may go to, in order: the current one, then every other pool of its class
/// that serves the request's model (config order). A request naming no model stays in its pool.
pub fn retry_pools(app: &ProxyState, ctx: &Ctx) -> Vec<usize> {
    let Some(current) = ctx.pool else {
        return Vec::new();
    };
    let pools = &app.pools;
    let Some(class) = pools.get(current).map(|h| h.class) else {
        return Vec::new();
    };
    let mut out = vec![current];
    let (Some(model), Some(snap)) = (model(ctx), ctx.snapshot.as_ref()) else {
        return out;
    };
    let serves = |p: usize| {
        snap.routes
            .pools
            .get(p)
            .is_some_and(|m| m.serves_model(model))
    };
    out.extend(
        pools
            .all()
            .filter(|h| h.index != current && h.class == class && serves(h.index))
            .map(|h| h.index),
    );
    out
}

/// Whether Sluice can send the request's body again: its own copy of a pre-read body, no body,
/// or a passed-through body Pingora's retry buffer still holds whole.
fn body_replayable(session: &Session, ctx: &Ctx) -> bool {
    match ctx.body_mode {
        BodyMode::Preread => true,
        BodyMode::Passthrough => !session.retry_buffer_truncated(),
        // Taken from its buffer when rewritten: not kept for a second attempt.
        BodyMode::Buffered => false,
    }
}

/// A failed attempt on the current backend: counted against it for passive ejection; then,
/// when `retryable` and nothing has reached the client, whether the request goes again. A
/// granted retry puts the backend in `ctx.tried` (so `upstream_peer` picks another).
pub fn on_failure(
    app: &ProxyState,
    session: &Session,
    ctx: &mut Ctx,
    cause: FailureCause,
    retryable: bool,
    detail: &dyn std::fmt::Display,
) -> bool {
    let pools = &app.pools;
    let Some(h) = ctx.pool.and_then(|i| pools.get(i)) else {
        return false;
    };
    if let (Some(passive), Some(backend)) = (ctx.passive.as_deref(), ctx.backend.as_deref()) {
        pools.failed(h, backend, passive, cause);
    }
    if !retryable || !nothing_sent(session) || !body_replayable(session, ctx) {
        return false;
    }
    match may_retry(app, ctx, h) {
        Ok(()) => {
            h.stats.retried(cause);
            // One line per retry (at most the budget's share of requests; Pingora's own is
            // suppressed): the request's path through the fleet, until the decision record
            // carries it.
            log::warn!(
                target: "sluice::proxy",
                "{}",
                serde_json::json!({"event": "upstream_retry", "request_id": ctx.request_id,
                                   "pool": h.label, "backend": ctx.backend.as_deref(),
                                   "cause": cause.as_str(), "attempt": ctx.attempts,
                                   "detail": detail.to_string()})
            );
            if let Some(b) = ctx.backend.clone() {
                ctx.tried.push(b);
            }
            true
        }
        Err(why) => {
            h.stats.denied(why);
            ctx.retry_denied = Some(why);
            false
        }
    }
}

/// The request's retries left, a replica it has not tried, then the budget (spent last, only
/// for a retry that happens).
fn may_retry(app: &ProxyState, ctx: &Ctx, failed_in: &PoolHandle) -> Result<(), RetryDenied> {
    let pools = &app.pools;
    let home = ctx
        .home_pool
        .and_then(|i| pools.get(i))
        .unwrap_or(failed_in);
    if u32::from(ctx.attempts) > home.retries {
        return Err(RetryDenied::Limit);
    }
    let mut tried = ctx.tried.clone();
    tried.extend(ctx.backend.clone());
    let model = model(ctx);
    let untried = ctx.snapshot.as_ref().is_some_and(|snap| {
        retry_pools(app, ctx).into_iter().any(|p| {
            pools
                .get(p)
                .is_some_and(|h| pools.has_untried(h, &snap.routes, model, &tried))
        })
    });
    if !untried {
        return Err(RetryDenied::NoReplica);
    }
    if !home.budget.try_retry(Instant::now()).allowed {
        return Err(RetryDenied::Budget);
    }
    Ok(())
}

/// `upstream_response_filter`: the replica's answer is in, nothing is written yet. A 502, 503
/// or 504 that may be retried becomes an error (Pingora then calls `error_while_proxy` and
/// writes nothing of it downstream); any other 5xx counts against the replica and goes through,
/// as does a 502/503/504 that may not be retried; anything else ends the replica's run of
/// failures.
pub fn upstream_response(
    app: &ProxyState,
    session: &Session,
    status: u16,
    ctx: &mut Ctx,
) -> Result<()> {
    if status < 500 {
        if let Some(p) = &ctx.passive {
            p.succeeded();
        }
        return Ok(());
    }
    let retryable = matches!(status, 502..=504);
    let detail = format_args!("the backend answered {status}");
    if on_failure(
        app,
        session,
        ctx,
        FailureCause::Status5xx,
        retryable,
        &detail,
    ) {
        ctx.retry_granted = true;
        crate::spans::attempt_failed(app, ctx, Some(status), &status, &detail);
        let mut e = Error::explain(
            ErrorType::Custom("upstream_status"),
            format!("the backend answered {status}; sent to another replica"),
        );
        e.set_retry(true);
        return Err(e.into_up());
    }
    Ok(())
}

/// `error_while_proxy`: an error after the connection was made. A retry granted for a status
/// goes ahead; an upstream error before anything reached the client (reset, closed, garbled
/// head) fails over; once the response has started (a stream cut mid-answer) the replica's
/// failure is counted and the error stands. Every path decides the retry, as Pingora requires.
pub fn error_while_proxy(
    app: &ProxyState,
    session: &Session,
    mut e: Box<Error>,
    ctx: &mut Ctx,
) -> Box<Error> {
    if std::mem::take(&mut ctx.retry_granted) {
        e.set_retry(true);
        return e;
    }
    let upstream_failure = *e.esource() == ErrorSource::Upstream
        && !matches!(
            e.etype(),
            ErrorType::ReadTimedout
                | ErrorType::WriteTimedout
                | ErrorType::HTTPStatus(_)
                | ErrorType::Custom(_)
        );
    let retry = upstream_failure && on_failure(app, session, ctx, FailureCause::Reset, true, &e);
    if retry {
        crate::spans::attempt_failed(app, ctx, None, &e.etype().as_str(), &e);
    }
    e.set_retry(retry);
    e
}

/// `fail_to_connect`: the connection was never made, so the request was not sent.
pub fn fail_to_connect(
    app: &ProxyState,
    session: &Session,
    ctx: &mut Ctx,
    mut e: Box<Error>,
) -> Box<Error> {
    let retry = on_failure(app, session, ctx, FailureCause::Connect, true, &e);
    if retry {
        crate::spans::attempt_failed(app, ctx, None, &e.etype().as_str(), &e);
    }
    e.set_retry(retry);
    e
}
