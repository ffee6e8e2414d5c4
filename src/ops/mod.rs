//! Operational endpoints served on the proxy listener by Sluice itself: probes, metrics, status,
//! recent decisions, the `/dashboard` page, and the admin signal overrides. They never reach a
//! backend.

mod admin;
mod status;

use crate::proxy::ctx::Ctx;
use crate::proxy::respond::{send, send_json};
use crate::proxy::App;
use bytes::Bytes;
use pingora::prelude::*;
use serde_json::json;

const PATHS: &[&str] = &[
    "/healthz",
    "/livez",
    "/readyz",
    "/metrics",
    "/status",
    "/decisions/recent",
    "/dashboard",
];

/// Self-contained (inline CSS and JS, no external resources) so it works offline and inside a
/// cluster without egress; it polls `/status` and `/decisions/recent` every second.
const DASHBOARD: &str = include_str!("dashboard.html");

pub fn is_ops_path(path: &str) -> bool {
    PATHS.contains(&path) || path.starts_with("/admin/")
}

pub async fn handle(app: &App, session: &mut Session, ctx: &mut Ctx) -> Result<()> {
    let path = session.req_header().uri.path().to_string();
    let method = session.req_header().method.as_str().to_string();
    if path.starts_with("/admin/") {
        return admin::handle(app, session, ctx, &path, &method).await;
    }
    if method != "GET" && method != "HEAD" {
        let body = json!({"error": {"type": "sluice_ops", "code": "method_not_allowed", "message": format!("{path} answers GET")}});
        return send_json(session, ctx, 405, &body, &[("allow", "GET, HEAD".into())]).await;
    }
    match path.as_str() {
        "/healthz" | "/livez" => send_json(session, ctx, 200, &json!({"status": "ok"}), &[]).await,
        "/readyz" => {
            let healthy = app.pools.healthy_count(&app.pools.on_demand);
            let draining = *app.draining.borrow();
            // Before the first policy sample every decision would fail open: not ready yet.
            let sampled = app.hub.sampled();
            let ready = healthy > 0 && !draining && sampled;
            let body = json!({
                "ready": ready,
                "draining": draining,
                "signals_sampled": sampled,
                "on_demand_healthy_backends": healthy,
                "coordinator": app.admission.kind(),
            });
            send_json(session, ctx, if ready { 200 } else { 503 }, &body, &[]).await
        }
        "/metrics" => {
            status::refresh_gauges(app);
            let body = Bytes::from(app.metrics.render());
            send(session, ctx, 200, "text/plain; version=0.0.4", body, &[]).await
        }
        "/status" => send_json(session, ctx, 200, &status::status(app), &[]).await,
        "/dashboard" => {
            let body = Bytes::from_static(DASHBOARD.as_bytes());
            send(session, ctx, 200, "text/html; charset=utf-8", body, &[]).await
        }
        "/decisions/recent" => {
            let query = session.req_header().uri.query().unwrap_or("").to_string();
            send_json(session, ctx, 200, &status::recent(app, &query).await, &[]).await
        }
        _ => {
            send_json(
                session,
                ctx,
                404,
                &json!({"error": {"type": "sluice_ops", "code": "not_found"}}),
                &[],
            )
            .await
        }
    }
}

/// Parses `a=1&b=x` (no percent-decoding needed for our parameter values).
pub(crate) fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}
