//! `PUT`/`DELETE` `/admin/{pressure,queue-depth,sla-violation-rate}`: force a signal value
//! (development and incident response). Who may call them is [`crate::auth`]'s question.

use crate::query::query_param;
use crate::respond::{bad, json_response, with_header};
use crate::state::OpsState;
use bytes::BytesMut;
use http::Response;
use pingora::protocols::http::ServerSession;
use serde_json::json;
use sluice_policy::SignalKind;

const MAX_ADMIN_BODY: usize = 4096;

/// Answers an `/admin/*` request: `PUT` sets an override, `DELETE` clears it.
pub async fn handle(
    ops: &OpsState,
    session: &mut ServerSession,
    path: &str,
    method: &str,
) -> Response<Vec<u8>> {
    let (kind, max) = match path {
        "/admin/pressure" => (SignalKind::Pressure, 100.0),
        "/admin/queue-depth" => (SignalKind::QueueDepth, f64::MAX),
        "/admin/sla-violation-rate" => (SignalKind::SlaViolationRate, 1.0),
        _ => return json_response(404, &bad("not_found", format!("no admin endpoint {path}"))),
    };
    let query = session.req_header().uri.query().unwrap_or("").to_string();
    // Default: the first on-demand pool, whose signals a two-pool fleet's tiers are judged on.
    let first = ops
        .pools
        .all()
        .find(|h| h.class == sluice_config::PoolClass::OnDemand)
        .or_else(|| ops.pools.get(0))
        .map_or("on-demand", |h| h.label);
    let pool_name = query_param(&query, "pool").unwrap_or(first);
    let Some(pool) = ops.hub.pool_index(pool_name) else {
        let names = ops.hub.pool_names().join(", ");
        let msg = format!("no pool is named {pool_name:?} (pools: {names})");
        return json_response(400, &bad("invalid_pool", msg));
    };
    match method {
        "DELETE" => {
            ops.hub.set_override(pool, kind, None);
            let body = json!({"signal": kind.as_str(), "pool": pool_name, "override": null});
            json_response(200, &body)
        }
        "PUT" => {
            let mut buf = BytesMut::new();
            loop {
                match session.read_request_body().await {
                    Ok(Some(chunk)) => {
                        buf.extend_from_slice(&chunk);
                        if buf.len() > MAX_ADMIN_BODY {
                            let msg = "admin bodies are {\"value\": N}";
                            return json_response(413, &bad("body_too_large", msg));
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return json_response(400, &bad("bad_body", e.to_string())),
                }
            }
            let value = match parse_value(&buf, max) {
                Ok(v) => v,
                Err(msg) => return json_response(400, &bad("invalid_value", msg)),
            };
            ops.hub.set_override(pool, kind, Some(value));
            log::warn!(
                "{}",
                json!({"event": "admin_override", "signal": kind.as_str(), "pool": pool_name, "value": value})
            );
            let body = json!({"signal": kind.as_str(), "pool": pool_name, "override": value});
            json_response(200, &body)
        }
        _ => with_header(
            json_response(405, &bad("method_not_allowed", "use PUT or DELETE")),
            "allow",
            "PUT, DELETE",
        ),
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
