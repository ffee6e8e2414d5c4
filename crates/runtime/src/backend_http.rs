//! A plain GET to a backend (its `/metrics`, its `/v1/models`) through Pingora's connector,
//! with the peer settings proxied requests use (TLS included): a TLS backend is asked over
//! https with exactly the SNI, CA and verification its requests get.

use crate::backend_tls::UpstreamTls;
use bytes::{Bytes, BytesMut};
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;
use std::sync::Arc;
use std::time::Duration;

/// How long a connection is kept for the next ask (the next round is about a second away).
const KEEPALIVE: Duration = Duration::from_secs(30);

/// `GET path` on `backend` (`host:port`, resolved on every call, so a backend that moves is
/// followed), bounded by `timeout` per step and `max_bytes` of body.
pub async fn get(
    connector: &Connector,
    backend: &str,
    tls: Option<&Arc<UpstreamTls>>,
    path: &str,
    timeout: Duration,
    max_bytes: usize,
) -> Result<Bytes, String> {
    let addr = tokio::net::lookup_host(backend)
        .await
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or("cannot resolve: no address")?;
    let mut peer = HttpPeer::new(addr, false, String::new());
    peer.options.connection_timeout = Some(timeout);
    peer.options.read_timeout = Some(timeout);
    if let Some(tls) = tls {
        tls.apply(&mut peer);
    }
    let (mut session, _reused) = connector
        .get_http_session(&peer)
        .await
        .map_err(|e| format!("connect failed: {e}"))?;
    let mut req = RequestHeader::build("GET", path.as_bytes(), None).map_err(|e| e.to_string())?;
    req.insert_header("Host", backend)
        .map_err(|e| e.to_string())?;
    let failed = |e: Box<pingora::Error>| format!("request failed: {e}");
    session
        .write_request_header(Box::new(req))
        .await
        .map_err(failed)?;
    session.finish_request_body().await.map_err(failed)?;
    session.read_response_header().await.map_err(failed)?;
    let status = session.response_header().map(|r| r.status);
    if let Some(status) = status.filter(|s| !s.is_success()) {
        return Err(format!("HTTP {status}"));
    }
    let mut body = BytesMut::new();
    while let Some(chunk) = session.read_response_body().await.map_err(failed)? {
        if body.len() + chunk.len() > max_bytes {
            return Err(format!("reading body: larger than {max_bytes} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    connector
        .release_http_session(session, &peer, Some(KEEPALIVE))
        .await;
    Ok(body.freeze())
}
