//! The signal sampler: every `scrape_interval_ms` it scrapes `/metrics` of every backend in the
//! on-demand and spot pools (concurrently, each bounded by `scrape_timeout_ms`), records the
//! aggregated round in the [`SignalHub`] and advances the policy by one sample.

use super::hub::{BackendScrape, ScrapeRound, SignalHub, SignalPool};
use super::vllm_text;
use crate::config::Config;
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::Arc;
use std::time::Duration;

/// Scraped bodies larger than this are refused: a vLLM /metrics page is a few tens of KiB.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

pub struct SignalSampler {
    hub: Arc<SignalHub>,
    pools: [(SignalPool, Vec<String>); 2],
    interval: Duration,
    timeout: Duration,
}

impl SignalSampler {
    pub fn new(cfg: &Config, hub: Arc<SignalHub>) -> Self {
        Self {
            hub,
            pools: [
                (SignalPool::OnDemand, cfg.pools.on_demand.backends.clone()),
                (SignalPool::Spot, cfg.pools.spot.backends.clone()),
            ],
            interval: Duration::from_millis(cfg.signals.scrape_interval_ms),
            timeout: Duration::from_millis(cfg.signals.scrape_timeout_ms),
        }
    }

    async fn round(&self, client: &Client<HttpConnector, Empty<Bytes>>) {
        let rounds = self.pools.iter().map(|(pool, backends)| async move {
            let scrapes = backends.iter().map(|b| scrape(client, b, self.timeout));
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

async fn scrape(
    client: &Client<HttpConnector, Empty<Bytes>>,
    backend: &str,
    timeout: Duration,
) -> BackendScrape {
    let fail = |error: String| BackendScrape {
        backend: backend.to_string(),
        kv_usage: None,
        waiting: None,
        queue_time: None,
        ttft: None,
        error: Some(error),
    };
    let uri = match format!("http://{backend}/metrics").parse::<http::Uri>() {
        Ok(u) => u,
        Err(e) => return fail(format!("bad address: {e}")),
    };
    let fetch = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
            .map_err(|e| format!("reading body: {e}"))?
            .to_bytes();
        Ok(body)
    };
    match tokio::time::timeout(timeout, fetch).await {
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

#[async_trait]
impl BackgroundService for SignalSampler {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build_http();
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => self.round(&client).await,
                _ = shutdown.changed() => {
                    // Keep sampling through the grace period so draining requests still see a
                    // live policy; the runtime drop ends this task.
                    if *shutdown.borrow() {
                        loop { ticker.tick().await; self.round(&client).await; }
                    }
                }
            }
        }
    }
}
