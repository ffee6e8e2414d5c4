//! Request-body phases: replace the body with its rewrite, byte-exact framing either way.
//! `request_body_filter` runs after the upstream is connected and the request header sent, and
//! again on every retry ([`crate::failover`]), so it must derive its output from `ctx` alone (no
//! "already sent" flag).

use super::ctx::{BodyMode, Ctx};
use super::ProxyState;
use crate::shaping::{self, Shaped};
use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::prelude::*;

pub fn upstream_request_filter(req: &mut RequestHeader, ctx: &mut Ctx) -> Result<()> {
    if let Some(b) = &ctx.new_body {
        req.insert_header("content-length", b.len().to_string())?;
        req.remove_header("transfer-encoding");
    } else if ctx.body_mode == BodyMode::Buffered {
        // Length unknown until the rewrite: Pingora frames it chunked for HTTP/1.1 upstreams.
        req.remove_header("content-length");
    }
    if ctx.body_mode == BodyMode::Preread {
        // Sluice read the body already, after its own `100 Continue` (admit::preread): a
        // backend's would be a second one.
        req.remove_header("expect");
    }
    req.insert_header_static("x-request-id", super::respond::request_id_value(ctx)?);
    Ok(())
}

pub fn request_body_filter(
    app: &ProxyState,
    body: &mut Option<Bytes>,
    eos: bool,
    ctx: &mut Ctx,
) -> Result<()> {
    match ctx.body_mode {
        BodyMode::Preread => {
            // The rewrite, or the body as read: Sluice's own copy on every attempt, whatever
            // Pingora's retry buffer holds.
            if let Some(new) = ctx.new_body.as_ref().or(ctx.preread_body.as_ref()) {
                *body = if eos {
                    Some(new.clone())
                } else {
                    Some(Bytes::new())
                };
            }
        }
        BodyMode::Buffered => {
            if let Some(chunk) = body.take() {
                ctx.buffer.extend_from_slice(&chunk);
            }
            limit(app, ctx.buffer.len())?;
            if !eos {
                // Hold back: `None` here would end the upstream body early.
                *body = Some(Bytes::new());
                return Ok(());
            }
            let raw = std::mem::take(&mut ctx.buffer).freeze();
            let rewrite = shaping::Rewrite {
                cap: ctx.cap,
                model: ctx.fallback_model.as_deref(),
                priority: ctx.priority,
            };
            *body = match shaping::shape(&raw, &rewrite) {
                Shaped::Unchanged(facts) => {
                    ctx.facts = Some(facts);
                    Some(raw)
                }
                Shaped::Rewritten {
                    body,
                    facts,
                    applied_max_tokens,
                } => {
                    ctx.facts = Some(facts);
                    ctx.applied_max_tokens = applied_max_tokens;
                    Some(body.into())
                }
                Shaped::NotJson => {
                    ctx.reason = Some(sluice_policy::Reason::InvalidJson);
                    return Error::e_explain(
                        HTTPStatus(400),
                        "body is not a JSON object and must be rewritten",
                    );
                }
            };
        }
        BodyMode::Passthrough => {
            ctx.body_seen += body.as_ref().map_or(0, Bytes::len);
            limit(app, ctx.body_seen)?;
        }
    }
    // A final empty chunk would write the chunk terminator twice (pingora#935), which strict
    // HTTP/1.1 servers such as vLLM's uvicorn reject.
    if eos && body.as_ref().is_some_and(|b| b.is_empty()) {
        *body = None;
    }
    Ok(())
}

fn limit(app: &ProxyState, seen: usize) -> Result<()> {
    let max = app.config.load().limits.max_body_bytes;
    if seen > max {
        return Error::e_explain(HTTPStatus(413), format!("request body exceeds {max} bytes"));
    }
    Ok(())
}
