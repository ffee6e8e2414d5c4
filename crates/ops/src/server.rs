//! The operations listener: a small HTTP server of its own (`ops_listen`), so nothing of it is
//! reachable through the tenant-facing port and none of its paths shadows a backend's.

use crate::auth::{self, Verdict};
use crate::respond::{bad, json_response, response, with_header};
use crate::state::OpsState;
use crate::{admin, status};
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::json;
use std::sync::Arc;

/// Self-contained (inline CSS and JS, no external resources) so it works offline and inside a
/// cluster without egress; it polls `/status` and `/decisions/recent` every second.
const DASHBOARD: &str = include_str!("dashboard.html");

/// The operations endpoints as a Pingora HTTP app; `Service::new(name, OpsServer { .. })` on
/// the `ops_listen` addresses.
pub struct OpsServer {
    pub state: Arc<OpsState>,
}

#[async_trait]
impl ServeHttp for OpsServer {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let ops = &self.state;
        let head = session.req_header();
        let path = head.uri.path().to_string();
        let method = head.method.as_str().to_string();
        let query = head.uri.query().unwrap_or("").to_string();
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let given = auth::bearer(
            session
                .req_header()
                .headers
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes()),
        );
        let token = ops.config.load().auth.admin_token.clone();
        if let Verdict::Unauthorized(why) = auth::check(&path, peer, token.as_deref(), given) {
            return with_header(
                json_response(401, &bad("unauthorized", why)),
                "www-authenticate",
                "Bearer",
            );
        }
        if path.starts_with("/admin/") {
            return admin::handle(ops, session, &path, &method).await;
        }
        if method != "GET" && method != "HEAD" {
            let msg = format!("{path} answers GET");
            return with_header(
                json_response(405, &bad("method_not_allowed", msg)),
                "allow",
                "GET, HEAD",
            );
        }
        match path.as_str() {
            "/healthz" | "/livez" => json_response(200, &json!({"status": "ok"})),
            "/readyz" => {
                let ready = status::readiness(ops);
                json_response(if ready.ready { 200 } else { 503 }, &ready)
            }
            "/metrics" => {
                status::refresh_gauges(ops);
                response(200, "text/plain; version=0.0.4", ops.metrics.render())
            }
            "/status" => json_response(200, &status::status(ops)),
            "/dashboard" => response(
                200,
                "text/html; charset=utf-8",
                DASHBOARD.as_bytes().to_vec(),
            ),
            "/decisions/recent" => json_response(200, &status::recent(ops, &query).await),
            _ => json_response(
                404,
                &bad("not_found", format!("no operations endpoint {path}")),
            ),
        }
    }
}
