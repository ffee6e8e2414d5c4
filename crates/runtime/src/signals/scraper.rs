//! The signal sampler: every `scrape_interval_ms` it scrapes `/metrics` of every backend in the
//! on-demand and spot pools (concurrently, each bounded by `scrape_timeout_ms`), records the
//! aggregated round in the [`SignalHub`] and advances the policy by one sample. It connects
//! through Pingora, as the proxy does, so a TLS backend is scraped over https with exactly the
//! SNI, CA and verification its requests get.

use super::hub::{BackendScrape, ScrapeRound, SignalHub, SignalPool};
use super::vllm_text;
use crate::backend_tls::{BackendTls, UpstreamTls};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures_util::future::join_all;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::upstreams::peer::HttpPeer;
use sluice_config::Config;
use std::sync::Arc;
use std::time::Duration;

/// Scraped bodies larger than this are refused: a vLLM /metrics page is a few tens of KiB.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;
/// How long a scrape connection is kept for the next round (a round is about a second away).
const KEEPALIVE: Duration = Duration::from_secs(30);

/// One backend to scrape: its `host:port` and, for a TLS backend, how to reach it.
type Target = (String, Option<Arc<UpstreamTls>>);

pub struct SignalSampler {
    hub: Arc<SignalHub>,
    pools: [(SignalPool, Vec<Target>); 2],
    interval: Duration,
    timeout: Duration,
}

impl SignalSampler {
    pub fn new(cfg: &Config, hub: Arc<SignalHub>, tls: &BackendTls) -> Self {
        let targets = |backends: &[String]| {
            backends
                .iter()
                .map(|b| (b.clone(), tls.get(b).cloned()))
                .collect()
        };
        Self {
            hub,
            pools: [
                (SignalPool::OnDemand, targets(&cfg.pools.on_demand.backends)),
                (SignalPool::Spot, targets(&cfg.pools.spot.backends)),
            ],
            interval: Duration::from_millis(cfg.signals.scrape_interval_ms),
            timeout: Duration::from_millis(cfg.signals.scrape_timeout_ms),
        }
    }

    async fn round(&self, connector: &Connector) {
        let rounds = self.pools.iter().map(|(pool, targets)| async move {
            let scrapes = targets.iter().map(|t| scrape(connector, t, self.timeout));
            let results = join_all(scrapes).await;
            (
                *pool,
                ScrapeRound::aggregate(self.hub.clock().now_ms(), results),
            )
        });
        for (pool, round) in join_all(rounds).await {
            if pool == SignalPool::Spot && round.backends.is_empty() {
                continue; // no spot pool configured: leave it unavailable rather than erroring
            }
            self.hub.record_scrape(pool, round);
        }
        self.hub.tick();
    }
}

async fn scrape(connector: &Connector, target: &Target, timeout: Duration) -> BackendScrape {
    let backend = target.0.as_str();
    let fail = |error: String| BackendScrape {
        backend: backend.to_string(),
        kv_usage: None,
        waiting: None,
        queue_time: None,
        ttft: None,
        error: Some(error),
    };
    match tokio::time::timeout(timeout, fetch(connector, target, timeout)).await {
        Err(_) => fail(format!("timed out after {} ms", timeout.as_millis())),
        Ok(Err(e)) => fail(e),
        Ok(Ok(body)) => {
            let reading = vllm_text::parse(&String::from_utf8_lossy(&body));
            let error = (reading.kv_usage.is_none() && reading.waiting.is_none())
                .then(|| "no vLLM metrics in the response".to_string());
            BackendScrape {
                backend: backend.to_string(),
                kv_usage: reading.kv_usage,
                waiting: reading.waiting,
                queue_time: reading.queue_time,
                ttft: reading.ttft,
                error,
            }
        }
    }
}

/// `GET /metrics` through Pingora's connector, with the peer settings proxied requests use
/// (TLS included). The name is resolved every round, so a backend that moves is followed.
async fn fetch(connector: &Connector, target: &Target, timeout: Duration) -> Result<Bytes, String> {
    let (backend, tls) = target;
    let addr = tokio::net::lookup_host(backend.as_str())
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
    let mut req = RequestHeader::build("GET", b"/metrics", None).map_err(|e| e.to_string())?;
    req.insert_header("Host", backend.as_str())
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
        if body.len() + chunk.len() > MAX_METRICS_BYTES {
            return Err(format!(
                "reading body: larger than {MAX_METRICS_BYTES} bytes"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    connector
        .release_http_session(session, &peer, Some(KEEPALIVE))
        .await;
    Ok(body.freeze())
}

#[async_trait]
impl BackgroundService for SignalSampler {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let connector = Connector::new(None);
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => self.round(&connector).await,
                _ = shutdown.changed() => {
                    // Keep sampling through the grace period so draining requests still see a
                    // live policy; the runtime drop ends this task.
                    if *shutdown.borrow() {
                        loop { ticker.tick().await; self.round(&connector).await; }
                    }
                }
            }
        }
    }
}
