//! `request_filter`: everything decided before vLLM is contacted — tenant and tier, body
//! pre-read, the model's pools, the policy decision, the in-flight slot or queue wait. A request
//! refused here never reaches a backend. Each step either fills the context or returns a
//! [`Refusal`].

use super::ctx::{BodyMode, Ctx};
use super::respond::{capacity_body, error_body, send_json};
use super::ProxyState;
use crate::shaping::{self, Priority, Rewrite, Shaped};
use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use sluice_policy::slo::{self, Slo};
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::{Action, PolicyState, Pool, PoolSignals, Reason, RequestFacts, Tier};
use sluice_record::Verdict;
use sluice_runtime::admission::{Admission, Claim, QueueParams};
use sluice_runtime::fleet::Route;
use sluice_runtime::signals::hub::Snapshot;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a request arriving right after start may wait for the first health checks.
const FIRST_CHECKS_WAIT: Duration = Duration::from_secs(2);

// Looked up by name on every request: parsed once here, not per lookup.
const X_TENANT_ID: http::HeaderName = http::HeaderName::from_static("x-tenant-id");
const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

static REQUEST_SEQ: AtomicU64 = AtomicU64::new(0);

/// `<replica>-<process start, unix ms, hex>-`, the start of every id Sluice generates. The start
/// time keeps ids unique across restarts of a pod whose name and pid repeat (pid 1 in a
/// container), so the ledger's idempotence key never merges two requests.
pub fn id_prefix(replica: &str) -> String {
    let boot = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    format!("{replica}-{boot:x}-")
}

/// An answer Sluice gives instead of proxying.
struct Refusal {
    status: u16,
    label: Verdict,
    reason: Reason,
    body: serde_json::Value,
    retry_after_s: Option<u64>,
}

impl Refusal {
    fn new(status: u16, reason: Reason, body: serde_json::Value) -> Self {
        Refusal {
            status,
            label: Verdict::Reject,
            reason,
            body,
            retry_after_s: None,
        }
    }

    fn request_error(status: u16, code: &str, reason: Reason, message: &str) -> Self {
        Self::new(
            status,
            reason,
            error_body("sluice_request", code, reason, message),
        )
    }

    /// An answer Sluice gives itself (not a refusal).
    fn answer(reason: Reason, body: serde_json::Value) -> Self {
        Refusal {
            label: Verdict::Pass,
            ..Self::new(200, reason, body)
        }
    }

    fn capacity(reason: Reason, tier: Tier, signals: &PoolSignals, retry_after_s: u64) -> Self {
        Refusal {
            retry_after_s: Some(retry_after_s),
            ..Self::new(429, reason, capacity_body(reason, tier, signals))
        }
    }
}

type Step<T> = Result<std::result::Result<T, Refusal>>;

pub async fn request_filter(
    app: &ProxyState,
    session: &mut Session,
    ctx: &mut Ctx,
) -> Result<bool> {
    ctx.received_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    ctx.request_id = request_id(app, session);
    crate::spans::start(app, session, ctx);
    // Upstream, names go in canonical case (see `respond::decision_headers`): the connection
    // guard has Pingora parse them without their case; any other session's case map is dropped
    // here, before Pingora copies the request header for the upstream.
    session.req_header_mut().drop_header_case();
    match decide_and_admit(app, session, ctx).await? {
        Ok(()) => Ok(false),
        Err(refusal) => {
            refuse(session, ctx, refusal).await?;
            Ok(true)
        }
    }
}

async fn decide_and_admit(app: &ProxyState, session: &mut Session, ctx: &mut Ctx) -> Step<()> {
    let req = session.req_header();
    let (method, path) = (req.method.as_str(), req.uri.path());
    let shapeable = shaping::is_shapeable(method, path);
    // Any API call with a body may name a model (embeddings, scoring): read it to route it.
    let routable = shapeable || (method == "POST" && path.starts_with("/v1/"));
    let listing = method == "GET" && path.trim_end_matches('/') == "/v1/models";
    let tier = match identify(app, session, ctx) {
        Ok(tier) => tier,
        Err(r) => return Ok(Err(r)),
    };
    let declared = match declared_length(app, session) {
        Ok(n) => n,
        Err(r) => return Ok(Err(r)),
    };
    // Limited by `declared_length` to `limits.max_body_bytes`. A chunked body is read whole
    // too (up to the same limit): its `model` picks the pool as a framed one's does.
    let chunked = declared.is_none()
        && session
            .req_header()
            .headers
            .get(http::header::TRANSFER_ENCODING)
            .is_some();
    let limit = if chunked {
        Some(app.config.load().limits.max_body_bytes)
    } else {
        declared
    };
    let raw = match limit.filter(|&n| routable && n > 0) {
        Some(n) => match preread(session, n, chunked).await? {
            Ok(raw) => {
                ctx.body_mode = BodyMode::Preread;
                ctx.facts = shaping::facts(&raw);
                Some(raw)
            }
            Err(r) => return Ok(Err(r)),
        },
        None => None,
    };

    ctx.prompt_tokens = match ctx.facts.as_ref().and_then(|f| f.prompt_tokens) {
        Some(n) => n,
        None => sluice_policy::work_gate::prompt_tokens_of_body(
            raw.as_ref().map_or(declared.unwrap_or(0), |r| r.len()),
        ),
    };
    let tier = match apply_quota(app, ctx, tier, shapeable).await {
        Ok(tier) => tier,
        Err(r) => return Ok(Err(r)),
    };
    app.pools.first_checks(FIRST_CHECKS_WAIT).await;
    let snap = app.hub.state();
    let rules = app.hub.rules();
    if listing && snap.routes.complete() {
        let data: Vec<&serde_json::Value> = snap.routes.listing().collect();
        let body = serde_json::json!({"object": "list", "data": data});
        return Ok(Err(Refusal::answer(Reason::ModelsListed, body)));
    }
    let model = ctx.facts.as_ref().and_then(|f| f.model.as_deref());
    let Some(route) = snap.routes.route(model.filter(|_| routable)) else {
        return Ok(Err(model_not_found(model.unwrap_or_default())));
    };
    decide(app, ctx, &snap, route, &rules, tier, shapeable);
    let state = snap.domain(route.domain);
    ctx.slo = objective(session, ctx, &rules, tier);
    if ctx.label == Some(Verdict::Pass) && ctx.quota.as_ref().is_some_and(|q| q.demoted()) {
        ctx.reason = Some(Reason::DemoteQuotaExceeded);
    }
    let decided_at = app.hub.clock().now_ms();
    if let Some(pool) = ctx.pool {
        app.hub.record_outcome(
            pool,
            sluice_policy::adaptive::Outcome::arrival(decided_at, tier),
        );
    }
    if let Some(r) = unattainable(ctx, state, tier, rules.adaptive.assumed_max_tokens) {
        return Ok(Err(r));
    }
    if ctx
        .decision
        .as_ref()
        .is_some_and(|d| d.action == Action::Reject)
    {
        let reason = ctx.reason.unwrap_or(Reason::RejectPressure);
        let retry = (rules.stability.cooldown_ms / 1000).max(1);
        return Ok(Err(Refusal::capacity(reason, tier, &state.signals, retry)));
    }
    if let Err(r) = shape(ctx, raw.clone(), shapeable, declared) {
        return Ok(Err(r));
    }
    if ctx.new_body.is_none() {
        // Kept (a reference, not a copy) to be sent again on a retry.
        ctx.preread_body = raw;
    }
    // Only completions hold capacity: model listings and health probes must not queue.
    // The request's estimated tokens: its share of a contended tier and its KV work.
    let completion = ctx.applied_max_tokens.and_then(|m| u64::try_from(m).ok());
    let work = sluice_policy::work_gate::work_of(
        ctx.prompt_tokens,
        completion,
        None,
        rules.adaptive.assumed_max_tokens,
    ) as u64;
    if shapeable {
        let capacity = rules.tier(tier).inflight_capacity;
        if let Err(r) = take_slot(app, session, ctx, tier, capacity, work, &state.signals).await {
            return Ok(Err(r));
        }
        if let Some(pool) = ctx.pool {
            ctx.work = app.hub.charge_work(pool, work, tier, decided_at);
        }
    }
    ctx.route = Some(route);
    ctx.snapshot = Some(snap);
    Ok(Ok(()))
}

/// The request's objective: its tier's, tightened by `x-llm-d-slo-ttft-ms` /
/// `x-llm-d-slo-tpot-ms` (or the older `x-slo-*`) unless its tenant may not.
fn objective(session: &Session, ctx: &Ctx, rules: &PolicyRules, tier: Tier) -> Slo {
    let slo = rules.tier(tier).slo;
    if !ctx.identity.as_ref().is_some_and(|i| i.slo_headers) {
        return slo;
    }
    let headers = &session.req_header().headers;
    let asked = |names: [&str; 2]| {
        names
            .iter()
            .find_map(|n| headers.get(*n))
            .and_then(|v| slo::parse_target_header(v.as_bytes()))
    };
    slo.tightened(asked(slo::TTFT_HEADERS), asked(slo::TPOT_HEADERS))
}

/// A Standard or Best-Effort request whose first token its pool cannot give in time now is
/// refused before it costs GPU time, with the estimate in the body (adaptive mode; a request
/// moved to the fallback is judged where it runs and is not refused for it). A whole answer's
/// first token may come as late as its deadline leaves room for (`slo::Asked`); a body without
/// `max_tokens` may run to `assumed_max_tokens`.
fn unattainable(
    ctx: &mut Ctx,
    state: &PolicyState,
    tier: Tier,
    assumed_max_tokens: u64,
) -> Option<Refusal> {
    let target = ctx.slo.ttft_ms?;
    let facts = ctx.facts.as_ref();
    let asked = slo::Asked {
        slo: ctx.slo,
        stream: facts.is_some_and(|f| f.stream),
        max_tokens: facts
            .and_then(|f| f.max_tokens)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(assumed_max_tokens),
    };
    let estimate = slo::refused_estimate(state, ctx.decision.as_ref()?, &asked)?;
    let delay = ctx
        .decision
        .as_ref()
        .and_then(|d| d.pool.signal_index())
        .and_then(|i| state.pools[i].delay_ms);
    let estimate = estimate.round();
    let why = match asked.stream {
        true => format!("past its {target} ms TTFT target"),
        false => format!(
            "too late for the whole answer to be complete within its {target} ms TTFT and {} ms \
             TPOT targets",
            asked.slo.tpot_ms.unwrap_or_default()
        ),
    };
    let reason = Reason::RejectSloUnattainable;
    ctx.reason = Some(reason);
    ctx.label = Some(Verdict::Reject);
    let body = serde_json::json!({"error": {
        "type": "sluice_capacity",
        "code": "slo_unattainable",
        "message": format!(
            "{tier} request rejected by Sluice: its first token is estimated at {estimate} ms on \
             this pool (vLLM's queue delay and prefill), {why}."
        ),
        "reason": reason.as_str(),
        "tier": tier.as_str(),
        "ttft_target_ms": target,
        "estimated_ttft_ms": estimate,
        "vllm_queue_delay_ms": delay.map(f64::round),
    }});
    // A retry can hope for the queue to have drained by then.
    let retry = (estimate / 1000.0).ceil().max(1.0) as u64;
    Some(Refusal {
        retry_after_s: Some(retry),
        ..Refusal::new(429, reason, body)
    })
}

/// OpenAI's answer for a model nobody serves, given before any backend is contacted.
fn model_not_found(model: &str) -> Refusal {
    let body = serde_json::json!({"error": {
        "message": format!("The model `{model}` does not exist."),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
        "reason": Reason::ModelNotFound.as_str(),
    }});
    Refusal::new(404, Reason::ModelNotFound, body)
}

fn request_id(app: &ProxyState, session: &Session) -> String {
    let given = session
        .req_header()
        .headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    match given {
        Some(id)
            if !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            id.to_string()
        }
        _ => generated_id(&app.id_prefix, REQUEST_SEQ.fetch_add(1, Ordering::Relaxed)),
    }
}

/// `<prefix><seq as at least 6 hex digits>`, without `format!` (a visible share of the
/// request path's cost at tens of thousands of requests per second).
fn generated_id(prefix: &str, seq: u64) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digits = (16 - seq.leading_zeros() as usize / 4).max(6);
    let mut id = String::with_capacity(prefix.len() + digits);
    id.push_str(prefix);
    for i in (0..digits).rev() {
        id.push(HEX[(seq >> (i * 4)) as usize & 0xf] as char);
    }
    id
}

/// Tenant and tier, from the API key or `X-Tenant-ID`.
fn identify(
    app: &ProxyState,
    session: &Session,
    ctx: &mut Ctx,
) -> std::result::Result<Tier, Refusal> {
    let headers = &session.req_header().headers;
    let tenant = headers.get(&X_TENANT_ID).map(|v| v.as_bytes());
    let auth = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match app.tenants.load().resolve(tenant, auth) {
        Ok(id) => {
            let tier = id.tier;
            ctx.identity = Some(id);
            Ok(tier)
        }
        Err(reason) => {
            let (status, code) = match reason {
                Reason::InvalidTenantHeader => (400, "invalid_header"),
                _ => (401, "unauthorized"),
            };
            let body = error_body("sluice_auth", code, reason, reason.describe());
            Err(Refusal::new(status, reason, body))
        }
    }
}

/// The declared body length, refused when over the limit; chunked uploads are counted as they
/// stream (`request_body_filter`).
fn declared_length(
    app: &ProxyState,
    session: &Session,
) -> std::result::Result<Option<usize>, Refusal> {
    let max = app.config.load().limits.max_body_bytes;
    let declared = match session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
    {
        None => None,
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
            Some(n) => Some(n),
            None => {
                let msg = "Content-Length is not a number";
                return Err(Refusal::request_error(
                    400,
                    "invalid_header",
                    Reason::InvalidJson,
                    msg,
                ));
            }
        },
    };
    if declared.is_some_and(|n| n > max) {
        let msg = format!("request body exceeds {max} bytes");
        return Err(Refusal::request_error(
            413,
            "body_too_large",
            Reason::BodyTooLarge,
            &msg,
        ));
    }
    Ok(declared)
}

/// Reads a body of `declared` bytes (at most, when `chunked`) whole, keeping Pingora's retry buffer (sized for it) so the
/// same bytes (or their rewrite) still go upstream.
async fn preread(session: &mut Session, declared: usize, chunked: bool) -> Step<Bytes> {
    session
        .downstream_session
        .enable_retry_buffering_up_to(declared);
    // A client that sent `Expect: 100-continue` sends its body only once told to: Pingora does
    // not answer it, so without this both sides wait (curl gives up after a second, others
    // never do). The upstream request then goes without the header (body::upstream_request_filter).
    if pingora::protocols::http::v1::common::is_expect_continue_req(session.req_header()) {
        session.write_continue_response().await?;
    }
    // Usually the whole body is one chunk (the guard read it ahead): kept as it is, not copied.
    // A second chunk starts a buffer holding both.
    let mut body = Bytes::new();
    let mut joined = BytesMut::new();
    while let Some(chunk) = session.read_request_body().await? {
        if body.is_empty() && joined.is_empty() {
            body = chunk;
        } else {
            if joined.is_empty() {
                joined.extend_from_slice(&body);
            }
            joined.extend_from_slice(&chunk);
        }
        if body.len().max(joined.len()) > declared {
            break;
        }
    }
    let body = if joined.is_empty() {
        body
    } else {
        joined.freeze()
    };
    if session.retry_buffer_truncated() || body.len() > declared {
        let msg = if chunked {
            format!("request body exceeds {declared} bytes")
        } else {
            "body longer than its Content-Length".to_string()
        };
        return Ok(Err(Refusal::request_error(
            413,
            "body_too_large",
            Reason::BodyTooLarge,
            &msg,
        )));
    }
    Ok(Ok(body))
}

/// The policy decision against the latest published state, on the pools of the request's
/// model, and the pool it goes to.
fn decide(
    app: &ProxyState,
    ctx: &mut Ctx,
    snap: &Snapshot,
    route: Route,
    rules: &sluice_policy::tenant_policy::PolicyRules,
    tier: Tier,
    shapeable: bool,
) {
    let routes = &snap.routes;
    let state = snap.domain(route.domain);
    let model = ctx.facts.as_ref().and_then(|f| f.model.as_deref());
    let usable = |pool: usize, model: Option<&str>| {
        app.pools
            .get(pool)
            .is_some_and(|h| app.pools.any_usable_for(h, routes, model))
    };
    // The first fallback model this request may move to that a pool with a usable backend
    // serves, and that pool.
    let cfg = app.config.load();
    let fallback = cfg
        .fallbacks
        .iter()
        .filter(|f| f.applies_to(model))
        .find_map(|f| {
            let r = routes.route(Some(&f.model))?;
            let pool = [Some(r.primary), r.spot]
                .into_iter()
                .flatten()
                .find(|&p| usable(p, Some(&f.model)))?;
            Some((f.model.as_str(), pool))
        });
    let in_domain = |p: usize| {
        if p == route.primary {
            Some(Pool::OnDemand)
        } else if Some(p) == route.spot {
            Some(Pool::Spot)
        } else {
            None
        }
    };
    // A fallback pool outside the request's domain is other capacity only while it is not
    // short itself (inside the domain the policy checks that).
    let saturated_elsewhere = fallback.is_some_and(|(_, p)| {
        in_domain(p).is_none() && snap.fleet.pools.get(p).is_some_and(|s| s.control.saturated)
    });
    let work = |p: Option<usize>| p.map_or(0.0, |p| app.hub.inflight_work_on(p));
    let facts = RequestFacts {
        tier,
        shapeable,
        fallback_available: fallback.is_some() && !saturated_elsewhere,
        spot_healthy: route.spot.is_some_and(|s| usable(s, model)),
        fallback_pool: fallback.and_then(|(_, p)| in_domain(p)),
        ticket: sluice_policy::adaptive::ticket_of(&ctx.request_id),
        prompt_tokens: ctx.prompt_tokens,
        max_tokens: ctx
            .facts
            .as_ref()
            .and_then(|f| f.max_tokens)
            .and_then(|m| u64::try_from(m).ok()),
        inflight_work: [work(Some(route.primary)), work(route.spot)],
    };
    let decision = sluice_policy::decide(state, rules, &facts);
    ctx.inputs = Some(sluice_record::PolicyInputs::capture(
        state,
        rules,
        &facts,
        &decision,
        app.hub.clock(),
    ));
    let (pool, route_reason) = match (decision.pool, fallback) {
        (Pool::Spot, _) => (route.spot.unwrap_or(route.primary), decision.route_reason),
        (Pool::Fallback, Some((_, p))) => (p, decision.route_reason),
        (_, _) if route.spot.is_none() && decision.route_reason == Reason::RouteSpotUnhealthy => {
            (route.primary, Reason::RouteNoSpotPool)
        }
        _ => (route.primary, decision.route_reason),
    };
    ctx.label = Some(verdict_of(&decision.action));
    ctx.reason = Some(decision.reason);
    ctx.pool = Some(pool);
    ctx.route_reason = Some(route_reason);
    ctx.cap = decision.action.max_tokens_cap();
    if let (Action::Fallback { .. }, Some((m, p))) = (&decision.action, fallback) {
        ctx.fallback_model = Some(m.to_string());
        ctx.fallback_pool = Some(p);
    }
    // vLLM orders its queue by `priority` only on pools that ask for it; elsewhere a client's
    // own is removed, so nobody buys a place in a queue that honours it.
    let vllm_priority = app.pools.get(pool).is_some_and(|h| h.vllm_priority);
    ctx.priority = match (shapeable, vllm_priority) {
        (true, true) => Priority::Set(tier.index() as i64),
        (true, false) if ctx.facts.as_ref().is_some_and(|f| f.has_priority) => Priority::Strip,
        _ => Priority::Keep,
    };
    ctx.decision = Some(decision);
}

/// The tenant's budget (when it has one): the tier it is served as — one lower when over
/// budget, so the policy, capacity, queue and pool are the lower tier's — or a 429 when it has
/// no lower tier. The identity then names the tier used, for the headers and the record.
async fn apply_quota(
    app: &ProxyState,
    ctx: &mut Ctx,
    tier: Tier,
    shapeable: bool,
) -> std::result::Result<Tier, Refusal> {
    let Some(id) = ctx.identity.as_ref().filter(|id| id.quota.is_some()) else {
        return Ok(tier);
    };
    let quota = id.quota.unwrap_or_default();
    let prompt = shapeable.then_some(ctx.prompt_tokens);
    let ticket = app.quotas.admit(&id.tenant, quota, tier, prompt).await;
    let refusal = ticket.refused.then(|| Refusal {
        retry_after_s: Some(ticket.retry_after_s()),
        ..Refusal::new(
            429,
            Reason::RejectQuotaExceeded,
            ticket.refusal_body(&id.tenant),
        )
    });
    let served = ticket.served;
    if ticket.demoted() {
        app.metrics
            .quota_demotions
            .with_label_values(&[tier.as_str(), served.as_str()])
            .inc();
    }
    ctx.quota = Some(ticket);
    if let Some(r) = refusal {
        return Err(r);
    }
    if let Some(id) = ctx.identity.as_mut() {
        id.tier = served;
    }
    Ok(served)
}

/// Rewrites a pre-read body now; a larger one that needs a rewrite is buffered later.
fn shape(
    ctx: &mut Ctx,
    raw: Option<Bytes>,
    shapeable: bool,
    declared: Option<usize>,
) -> std::result::Result<(), Refusal> {
    let rewrite = Rewrite {
        cap: ctx.cap,
        model: ctx.fallback_model.as_deref(),
        priority: ctx.priority,
    };
    let needs_rewrite = rewrite.any(ctx.facts.as_ref());
    match raw {
        // Nothing to change: the facts read at pre-read say all there is (no second parse).
        Some(_) if !needs_rewrite && ctx.facts.is_none() => {
            ctx.reason = Some(Reason::BodyNotJsonForwarded)
        }
        Some(_) if !needs_rewrite => {}
        Some(raw) => match shaping::shape(&raw, &rewrite) {
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
                let msg = "the decision needs to rewrite the body, which is not a JSON object";
                return Err(Refusal::request_error(
                    400,
                    "invalid_json",
                    Reason::InvalidJson,
                    msg,
                ));
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
    Ok(())
}

/// Takes an in-flight slot, waiting in the tier's queue when the tier queues. Draining ends any
/// wait at once: dropping the admit future leaves the queue, and its slot, if any, goes on.
async fn take_slot(
    app: &ProxyState,
    session: &mut Session,
    ctx: &mut Ctx,
    tier: Tier,
    capacity: u32,
    cost_tokens: u64,
    signals: &PoolSignals,
) -> std::result::Result<(), Refusal> {
    let queue = ctx.decision.as_ref().filter(|d| d.queue_eligible).map(|_| {
        let q = &app.config.load().queue;
        QueueParams {
            max_size: q.max_size,
            max_wait: Duration::from_millis(q.max_wait_ms()),
            poll: Duration::from_millis(q.poll_ms()),
        }
    });
    let claim = ctx.identity.as_ref().map_or(Claim::ANONYMOUS, |id| Claim {
        tenant: &id.tenant,
        weight: id.weight,
        cost_tokens,
    });
    let mut admit = app.admission.admit_as(tier, capacity, queue, &claim);
    // Most requests are admitted at the first poll; only one that waits listens for the drain
    // (which refuses it). Subscribing and checking the drain's channel on every request moved
    // its counters and lock between the cores; and a request the drain found admitted at once
    // was served or refused by the toss of `select!`'s branch order.
    let first = std::future::poll_fn(|cx| Poll::Ready(Future::poll(admit.as_mut(), cx))).await;
    let admitted = match first {
        Poll::Ready(a) => a,
        Poll::Pending => {
            let mut draining = app.lifecycle.subscribe();
            let waited = std::time::Instant::now();
            // A client that leaves while its request waits takes it out of the queue: sent
            // later, it would hold a backend for an answer nobody reads.
            let body_done = session.is_body_done();
            let gone = async {
                if !body_done {
                    return std::future::pending().await;
                }
                let _ = session.downstream_session.read_body_or_idle(true).await;
            };
            tokio::select! {
                biased;
                a = &mut admit => a,
                _ = draining.wait_for(|d| *d) => Admission::Refused { reason: Reason::Draining, queued_for: None },
                _ = gone => Admission::Refused { reason: Reason::ClientGone, queued_for: Some(waited.elapsed()) },
            }
        }
    };
    let queue_wait = |outcome: &str, q: Duration| {
        app.metrics
            .queue_wait
            .with_label_values(&[tier.as_str(), outcome])
            .observe(q.as_secs_f64())
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
                queue_wait("released", q);
                crate::spans::queue_left(&mut ctx.spans, q, "released");
                ctx.queued_for = Some(q);
                ctx.label = Some(Verdict::Queue);
                // A wait that ended because the coordinator went away keeps saying so.
                if !fail_open {
                    ctx.reason = Some(Reason::QueueReleased);
                }
            }
            Ok(())
        }
        Admission::Refused {
            reason: Reason::Draining,
            ..
        } => {
            let msg = "Sluice is shutting down; retry on another replica";
            let body = error_body("sluice_draining", "draining", Reason::Draining, msg);
            ctx.closing = true;
            Err(Refusal {
                retry_after_s: Some(1),
                ..Refusal::new(503, Reason::Draining, body)
            })
        }
        Admission::Refused {
            reason: Reason::ClientGone,
            queued_for,
        } => {
            if let Some(q) = queued_for {
                crate::spans::queue_left(&mut ctx.spans, q, Reason::ClientGone.as_str());
            }
            ctx.queued_for = queued_for;
            ctx.error = Some(sluice_record::Failure::ClientGone);
            ctx.closing = true;
            let msg = "the client went away while the request waited";
            let body = error_body("sluice_request", "client_gone", Reason::ClientGone, msg);
            // nginx's "client closed request": nobody reads it.
            Err(Refusal {
                label: Verdict::Queue,
                ..Refusal::new(499, Reason::ClientGone, body)
            })
        }
        Admission::Refused { reason, queued_for } => {
            ctx.queued_for = queued_for;
            if let Some(q) = queued_for {
                queue_wait(reason.as_str(), q);
                crate::spans::queue_left(&mut ctx.spans, q, reason.as_str());
            }
            let mut refusal = Refusal::capacity(reason, tier, signals, 1);
            if queued_for.is_some() || reason == Reason::QueueDropped {
                refusal.label = Verdict::Queue;
            }
            Err(refusal)
        }
    }
}

async fn refuse(session: &mut Session, ctx: &mut Ctx, r: Refusal) -> Result<()> {
    ctx.label = Some(r.label);
    ctx.reason = Some(r.reason);
    ctx.pool = None;
    ctx.route_reason = None;
    if ctx.error == Some(sluice_record::Failure::ClientGone) {
        ctx.status = r.status;
        session.set_keepalive(None);
        return Ok(());
    }
    let extra: Vec<(&str, String)> = r
        .retry_after_s
        .map(|s| ("retry-after", s.to_string()))
        .into_iter()
        .collect();
    send_json(session, ctx, r.status, &r.body, &extra).await
}

/// The decision header's value for what the policy decided.
fn verdict_of(action: &Action) -> Verdict {
    match action {
        Action::Pass => Verdict::Pass,
        Action::Degrade { .. } => Verdict::Degrade,
        Action::Fallback { .. } => Verdict::Fallback,
        Action::Reject => Verdict::Reject,
    }
}

#[cfg(test)]
mod tests {
    use super::generated_id;

    #[test]
    fn generated_ids_are_the_prefix_and_at_least_six_hex_digits() {
        for seq in [
            0,
            1,
            0xabc,
            0xffffff,
            0x1000000,
            0xfffffff,
            0x10000000,
            u64::MAX,
        ] {
            assert_eq!(
                generated_id("pod-1-18f-", seq),
                format!("pod-1-18f-{seq:06x}")
            );
        }
    }
}
