//! The signal sampler: every `scrape_interval_ms` it scrapes `/metrics` of every backend of
//! every pool (concurrently, each bounded by `scrape_timeout_ms`), records each pool's
//! aggregated round in the [`SignalHub`] and each backend's figures for replica choice, and
//! advances the policy by one sample. It connects through Pingora, as the proxy does, so a TLS
//! backend is scraped over https with exactly the SNI, CA and verification its requests get.

use super::hub::{BackendScrape, PoolIndex, ScrapeRound, SignalHub};
use super::vllm_text;
use crate::backend_tls::{BackendTls, UpstreamTls};
use crate::fleet::BackendLoads;
use async_trait::async_trait;
use futures_util::future::join_all;
use pingora::connectors::http::Connector;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sluice_config::Config;
use std::sync::Arc;
use std::time::Duration;

/// Scraped bodies larger than this are refused: a vLLM /metrics page is a few tens of KiB.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// One backend to scrape: its `host:port` and, for a TLS backend, how to reach it.
type Target = (String, Option<Arc<UpstreamTls>>);

pub struct SignalSampler {
    hub: Arc<SignalHub>,
    /// Each pool's backends, by pool index.
    pools: Vec<(PoolIndex, Vec<Target>)>,
    loads: Arc<BackendLoads>,
    interval: Duration,
    timeout: Duration,
}

impl SignalSampler {
    pub fn new(
        cfg: &Config,
        hub: Arc<SignalHub>,
        tls: &BackendTls,
        loads: Arc<BackendLoads>,
    ) -> Self {
        let targets = |backends: &[String]| {
            backends
                .iter()
                .map(|b| (b.clone(), tls.get(b).cloned()))
                .collect()
        };
        Self {
            hub,
            pools: cfg
                .pools
                .iter()
                .enumerate()
                .map(|(i, p)| (i, targets(&p.config.backends)))
                .collect(),
            loads,
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
            for b in &round.backends {
                self.loads.record_scrape(&b.backend, b.kv_usage, b.waiting);
                if let Some(p) = b.prefix_cache {
                    self.loads.record_prefix_counters(&b.backend, p);
                }
            }
            if round.backends.is_empty() {
                continue; // a pool without backends: leave it unavailable rather than erroring
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
        itl: None,
        prefix_cache: None,
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
                itl: reading.itl,
                prefix_cache: reading.prefix_cache,
                error,
            }
        }
    }
}

/// `GET /metrics` of one backend.
async fn fetch(
    connector: &Connector,
    target: &Target,
    timeout: Duration,
) -> Result<bytes::Bytes, String> {
    let (backend, tls) = target;
    crate::backend_http::get(
        connector,
        backend,
        tls.as_ref(),
        "/metrics",
        timeout,
        MAX_METRICS_BYTES,
    )
    .await
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
