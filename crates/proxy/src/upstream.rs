//! Choosing the backend: the decision's pool and a backend of it that has passed a health check
//! and is not ejected; on a retry ([`crate::failover`]) one the request has not tried, of its
//! pool, then of another pool of its class serving its model.

use super::ctx::Ctx;
use super::failover;
use super::ProxyState;
use pingora::prelude::*;
use sluice_config::PoolClass;
use sluice_policy::Reason;
use sluice_record::Verdict;
use sluice_runtime::pools::Want;
use std::time::Duration;

pub fn upstream_peer(
    app: &ProxyState,
    session: &mut Session,
    ctx: &mut Ctx,
) -> Result<Box<HttpPeer>> {
    if ctx.overhead.is_none() {
        let spent = ctx.started.map(|s| s.elapsed()).unwrap_or_default();
        ctx.overhead = Some(spent.saturating_sub(ctx.queued_for.unwrap_or_default()));
    }
    let pools = &app.pools;
    let mut index = ctx.pool.unwrap_or(0);
    let model = ctx
        .fallback_model
        .as_deref()
        .or_else(|| ctx.facts.as_ref().and_then(|f| f.model.as_deref()));
    let routes = ctx.snapshot.as_ref().map(|s| &s.routes);
    let exclude = &ctx.tried[..];
    let pick = |index: usize| {
        let h = pools.get(index)?;
        let models = routes
            .and_then(|r| r.pools.get(index))
            .filter(|m| !m.uniform);
        let serves = |b: &str| models.is_none_or(|m| m.serves(b, model));
        let want = Want {
            serves: models.map(|_| &serves as &dyn Fn(&str) -> bool),
            prefix: ctx.facts.as_ref().and_then(|f| f.prefix),
            exclude,
        };
        pools.select(h, want)
    };
    let retry = ctx.attempts > 0;
    let mut picked = None;
    if retry {
        // Its pool first, then the other pools of that class serving its model.
        for p in failover::retry_pools(app, ctx) {
            picked = pick(p);
            if picked.is_some() {
                index = p;
                break;
            }
        }
    } else {
        picked = pick(index);
        // Spot emptied between the decision and now: Best-Effort is evicted, not failed.
        let spot = pools.get(index).is_some_and(|h| h.class == PoolClass::Spot);
        if let (None, true, Some(route)) = (&picked, spot, ctx.route) {
            if route.primary != index {
                index = route.primary;
                ctx.route_reason = Some(Reason::RouteSpotUnhealthy);
                picked = pick(index);
            }
        }
    }
    let Some((backend, info, affinity)) = picked else {
        ctx.reason = Some(Reason::BackendUnavailable);
        ctx.label = Some(Verdict::Error);
        let name = pools.get(index).map_or("?", |h| h.name.as_str());
        return Error::e_explain(
            HTTPStatus(503),
            format!("no healthy backend in pool {name}"),
        );
    };
    ctx.pool = Some(index);
    ctx.pool_label = pools.get(index).map(|h| h.label);
    if retry {
        // The body goes again from its start (the retry buffer or Sluice's copy).
        ctx.body_seen = 0;
    } else {
        // The request counts once in its pool's retry budget, where its retries are spent; by
        // its arrival, which saves reading the clock again.
        ctx.home_pool = Some(index);
        if let Some(h) = pools.get(index) {
            h.budget
                .request(ctx.started.unwrap_or_else(std::time::Instant::now));
        }
    }
    ctx.attempts = ctx.attempts.saturating_add(1);
    // A retry moves the request: the previous backend's count goes back.
    ctx.lease = Some(info.load.lease());
    ctx.affinity = affinity;
    ctx.passive = Some(info.passive);
    super::spans::attempt(app, session, ctx, &info.name);
    ctx.backend = Some(info.name);
    let limits = &app.config.load().limits;
    let tls = info.tls;
    let mut peer = HttpPeer::new(backend, false, String::new());
    if let Some(tls) = tls {
        tls.apply(&mut peer);
    }
    peer.options.connection_timeout =
        Some(Duration::from_millis(limits.upstream_connect_timeout_ms));
    peer.options.total_connection_timeout = Some(Duration::from_millis(
        limits.upstream_connect_timeout_ms * 2,
    ));
    peer.options.read_timeout = Some(Duration::from_millis(limits.upstream_read_timeout_ms));
    peer.options.idle_timeout = Some(Duration::from_millis(limits.upstream_idle_timeout_ms));
    // The request header waits in the write buffer for a Content-Length body and shares its
    // send: one segment and one wake of the backend instead of two (vendor/pingora-core).
    peer.options.coalesce_request_header = true;
    // The response's names go out in canonical case (`respond::decision_headers`), so their
    // parsed case is not kept, and the map has room for the decision headers: neither a case
    // map filled and dropped nor the map grown on every response (vendor/pingora-core).
    peer.options.preserve_response_header_case = false;
    peer.options.response_header_room = super::respond::DECISION_HEADERS;
    Ok(Box::new(peer))
}

/// `fail_to_connect`: counted per pool, then failed over ([`failover::fail_to_connect`]).
pub fn fail_to_connect(
    app: &ProxyState,
    session: &Session,
    ctx: &mut Ctx,
    e: Box<Error>,
) -> Box<Error> {
    let pool = ctx
        .pool
        .and_then(|i| app.pools.get(i))
        .map_or("unknown", |h| h.label);
    app.metrics
        .upstream_errors
        .with_label_values(&[pool, "connect"])
        .inc();
    failover::fail_to_connect(app, session, ctx, e)
}
