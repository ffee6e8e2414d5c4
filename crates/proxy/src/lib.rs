//! The Pingora glue. [`Sluice`] implements `ProxyHttp`; each phase delegates to one module:
//! - `request_filter` ([`admit`]): tenant, body pre-read, policy, admission;
//! - `upstream_peer` ([`upstream`]): a usable backend of the pool, one not tried yet on a retry;
//! - `fail_to_connect`, `upstream_response_filter`, `error_while_proxy` ([`failover`]): a request
//!   that failed before its first byte is sent to another replica, within its retries and the
//!   pool's budget; every failure counts toward its replica's ejection;
//! - `request_body_filter` ([`body`]): swaps in the rewritten JSON body (or Sluice's copy);
//! - response filters and `logging` ([`outcome`]): headers, usage, the decision record, metrics;
//! - distributed tracing through all of them ([`spans`]): the request's SERVER span, a CLIENT
//!   span per upstream attempt and the `traceparent` sent to vLLM, when tracing is on.
//!
//! In front of all of them, [`conn_guard`] owns each client connection: connection limit,
//! header limits and timeouts, framing checks ([`head_check`]) before Pingora parses a byte.

pub mod admit;
pub mod body;
pub mod conn_guard;
pub mod ctx;
pub mod failover;
pub mod head_check;
pub mod outcome;
pub mod respond;
pub mod shaping;
pub mod spans;
pub mod upstream;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use ctx::Ctx;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyWarnLogContext};
use sluice_config::tenancy::TenantDirectory;
use sluice_config::Config;
use sluice_record::DecisionSink;
use sluice_record::Failure;
use sluice_runtime::admission::AdmissionControl;
use sluice_runtime::lifecycle::Lifecycle;
use sluice_runtime::metrics::Metrics;
use sluice_runtime::pools::PoolSet;
use sluice_runtime::quota::Quotas;
use sluice_runtime::ring::DecisionRing;
use sluice_runtime::signals::SignalHub;
use std::sync::Arc;
use std::time::Instant;

/// Everything the request path reads: handles to the runtime services, shared with the
/// operations listener and the process's services (each of which gets only the handles it uses).
/// Hot-swappable parts sit behind `ArcSwap` so a request keeps the rules it started with.
pub struct ProxyState {
    pub config: Arc<ArcSwap<Config>>,
    pub tenants: Arc<ArcSwap<TenantDirectory>>,
    pub hub: Arc<SignalHub>,
    pub pools: Arc<PoolSet>,
    pub admission: Arc<dyn AdmissionControl>,
    /// Per-tenant budgets (`tenants.<name>.quota`).
    pub quotas: Arc<Quotas>,
    pub metrics: Arc<Metrics>,
    pub decisions: Arc<DecisionRing>,
    /// Durable destinations of decision records (the PostgreSQL ledger when configured).
    pub sinks: Arc<[Arc<dyn DecisionSink>]>,
    pub lifecycle: Arc<Lifecycle>,
    /// Leaked once at start-up: every record borrows it instead of copying it.
    pub replica: &'static str,
    /// Generated request ids start with this ([`admit::id_prefix`]).
    pub id_prefix: String,
    /// Starts and ends the requests' spans ([`spans`]); `Tracer::disabled()` when tracing is off.
    pub tracer: sluice_trace::Tracer,
}

pub struct Sluice {
    pub app: Arc<ProxyState>,
}

#[async_trait]
impl ProxyHttp for Sluice {
    // Boxed: Pingora keeps the context by value in its per-request future, several times over
    // across its states, and moves that whole future into a fresh box for every request (the
    // `async_trait` of `process_new_http`); inline, the context made that copy 16 KiB.
    type CTX = Box<Ctx>;

    fn new_ctx(&self) -> Box<Ctx> {
        Box::new(Ctx {
            started: Some(Instant::now()),
            active: Some(self.app.lifecycle.enter()),
            closing: self.app.lifecycle.closing(),
            refused_body_drain: {
                let l = &self.app.config.load().limits;
                (
                    l.refused_body_drain_bytes,
                    std::time::Duration::from_millis(l.refused_body_drain_ms),
                )
            },
            ..Default::default()
        })
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        admit::request_filter(&self.app, session, ctx).await
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        upstream::upstream_peer(&self.app, session, ctx)
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Self::CTX,
        e: Box<Error>,
    ) -> Box<Error> {
        upstream::fail_to_connect(&self.app, session, ctx, e)
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Self::CTX,
        _client_reused: bool,
    ) -> Box<Error> {
        let e = e.more_context(format!("Peer: {peer}"));
        failover::error_while_proxy(&self.app, session, e, ctx)
    }

    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        failover::upstream_response(&self.app, session, resp.status.as_u16(), ctx)
    }

    async fn upstream_request_filter(
        &self,
        _s: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        body::upstream_request_filter(req, ctx)?;
        spans::inject(req, ctx)
    }

    async fn request_body_filter(
        &self,
        _s: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        body::request_body_filter(&self.app, body, end_of_stream, ctx)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if self.app.lifecycle.closing() {
            session.set_keepalive(None);
        }
        outcome::response_filter(resp, ctx)
    }

    fn response_body_filter(
        &self,
        _s: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<Option<std::time::Duration>> {
        outcome::response_body_filter(&self.app, body, end_of_stream, ctx);
        Ok(None)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Self::CTX,
    ) -> FailToProxy {
        outcome::fail_to_proxy(&self.app, session, e, ctx).await
    }

    fn suppress_proxy_warn_log(
        &self,
        _s: &Session,
        _ctx: &Self::CTX,
        _e: &Error,
        context: ProxyWarnLogContext,
    ) -> bool {
        // Each retry has its own `upstream_retry` line, with the request id ([`failover`]).
        matches!(context, ProxyWarnLogContext::UpstreamRetry)
    }

    fn suppress_error_log(&self, _s: &Session, ctx: &Self::CTX, _e: &Error) -> bool {
        // Client cancels and our own refusals are recorded in the decision log already.
        ctx.error == Some(Failure::ClientGone)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Self::CTX) {
        outcome::logging(&self.app, session, e, ctx);
    }
}
