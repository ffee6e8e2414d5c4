//! `PUT`/`DELETE` `/admin/{pressure,queue-depth,sla-violation-rate}`: force a signal value
//! (development and incident response). Authenticated by `SLUICE_ADMIN_TOKEN`, separately from
//! tenant keys; with no token configured only loopback peers may use them.

use super::query_param;
use crate::policy::SignalKind;
use crate::proxy::ctx::Ctx;
use crate::proxy::respond::send_json;
use crate::proxy::App;
use crate::signals::hub::SignalPool;
use bytes::BytesMut;
use pingora::prelude::*;
use serde_json::json;

const MAX_ADMIN_BODY: usize = 4096;

fn bad(code: &str, msg: impl Into<String>) -> serde_json::Value {
    json!({"error": {"type": "sluice_admin", "code": code, "message": msg.into()}})
}

fn authorized(app: &App, session: &Session) -> Result<(), (u16, serde_json::Value)> {
    let token = app.config.load().auth.admin_token.clone();
    match token {
        Some(token) => {
            let given = session
                .req_header()
                .headers
                .get("authorization")
                .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
                .unwrap_or_default();
            // Length leaks nothing useful; the byte comparison itself is constant time.
            let equal = given.len() == token.len()
                && given
                    .iter()
                    .zip(token.as_bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0;
            if equal {
                Ok(())
            } else {
                Err((
                    401,
                    bad(
                        "unauthorized",
                        "admin endpoints need Authorization: Bearer $SLUICE_ADMIN_TOKEN",
                    ),
                ))
            }
        }
        None => {
            let loopback = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .is_some_and(|a| a.ip().is_loopback());
            if loopback {
                Ok(())
            } else {
                Err((
                    403,
                    bad(
                        "forbidden",
                        "no admin token configured: admin endpoints answer loopback only",
                    ),
                ))
            }
        }
    }
}

pub async fn handle(
    app: &App,
    session: &mut Session,
    ctx: &mut Ctx,
    path: &str,
    method: &str,
) -> Result<()> {
    if let Err((status, body)) = authorized(app, session) {
        return send_json(session, ctx, status, &body, &[]).await;
    }
    let (kind, max) = match path {
        "/admin/pressure" => (SignalKind::Pressure, 100.0),
        "/admin/queue-depth" => (SignalKind::QueueDepth, f64::MAX),
        "/admin/sla-violation-rate" => (SignalKind::SlaViolationRate, 1.0),
        _ => {
            return send_json(
                session,
                ctx,
                404,
                &bad("not_found", format!("no admin endpoint {path}")),
                &[],
            )
            .await
        }
    };
    let query = session.req_header().uri.query().unwrap_or("").to_string();
    let pool_name = query_param(&query, "pool").unwrap_or("on-demand");
    let Some(pool) = SignalPool::parse(pool_name) else {
        return send_json(
            session,
            ctx,
            400,
            &bad(
                "invalid_pool",
                format!("pool {pool_name:?} is not on-demand or spot"),
            ),
            &[],
        )
        .await;
    };
    match method {
        "DELETE" => {
            app.hub.set_override(pool, kind, None);
            let body = json!({"signal": kind.as_str(), "pool": pool_name, "override": null});
            send_json(session, ctx, 200, &body, &[]).await
        }
        "PUT" => {
            let mut buf = BytesMut::new();
            while let Some(chunk) = session.read_request_body().await? {
                buf.extend_from_slice(&chunk);
                if buf.len() > MAX_ADMIN_BODY {
                    return send_json(
                        session,
                        ctx,
                        413,
                        &bad("body_too_large", "admin bodies are {\"value\": N}"),
                        &[],
                    )
                    .await;
                }
            }
            let value = match parse_value(&buf, max) {
                Ok(v) => v,
                Err(msg) => {
                    return send_json(session, ctx, 400, &bad("invalid_value", msg), &[]).await
                }
            };
            app.hub.set_override(pool, kind, Some(value));
            log::warn!(
                "{}",
                json!({"event": "admin_override", "signal": kind.as_str(), "pool": pool_name, "value": value})
            );
            let body = json!({"signal": kind.as_str(), "pool": pool_name, "override": value});
            send_json(session, ctx, 200, &body, &[]).await
        }
        _ => {
            send_json(
                session,
                ctx,
                405,
                &bad("method_not_allowed", "use PUT or DELETE"),
                &[("allow", "PUT, DELETE".into())],
            )
            .await
        }
    }
}

fn parse_value(body: &[u8], max: f64) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let n = v
        .get("value")
        .ok_or("body must be {\"value\": N}")?
        .as_f64()
        .ok_or("value must be a number")?;
    if !n.is_finite() || n < 0.0 || n > max {
        return Err(format!("value {n} is outside 0..={max}"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::parse_value;

    #[test]
    fn values_are_range_checked() {
        assert_eq!(parse_value(br#"{"value": 65}"#, 100.0), Ok(65.0));
        assert!(parse_value(br#"{"value": 101}"#, 100.0)
            .unwrap_err()
            .contains("outside"));
        assert!(parse_value(br#"{"value": -1}"#, 1.0).is_err());
        assert!(parse_value(br#"{"value": "x"}"#, 1.0)
            .unwrap_err()
            .contains("number"));
        assert!(parse_value(b"nope", 1.0).unwrap_err().contains("JSON"));
        assert!(parse_value(br#"{"v": 1}"#, 1.0).is_err());
    }
}
