//! Which models each backend serves, for pools that do not declare them: every backend's
//! `/v1/models` (base models and LoRA adapters, as vLLM lists them), asked at start and then
//! periodically, so an adapter loaded later is routed to the backends that have it. A change
//! rebuilds the routing table and hands it on (to the policy, which follows its layout).

use super::PoolSet;
use crate::fleet::Routes;
use async_trait::async_trait;
use pingora::connectors::http::Connector;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::Arc;
use std::time::Duration;

/// A `/v1/models` answer is small; a larger one is not vLLM's.
const MAX_MODELS_BYTES: usize = 1024 * 1024;

pub struct ModelDiscovery {
    pools: Arc<PoolSet>,
    /// Between asks once every backend has answered; until then, every `eager`.
    every: Duration,
    eager: Duration,
    timeout: Duration,
    on_change: Box<dyn Fn(Arc<Routes>) + Send + Sync>,
}

impl ModelDiscovery {
    pub fn new(
        pools: Arc<PoolSet>,
        every: Duration,
        timeout: Duration,
        on_change: Box<dyn Fn(Arc<Routes>) + Send + Sync>,
    ) -> Self {
        ModelDiscovery {
            pools,
            every,
            eager: every.min(Duration::from_secs(1)),
            timeout,
            on_change,
        }
    }

    /// Whether any backend has something to discover.
    pub fn needed(&self) -> bool {
        self.pools.fleet.pools.iter().any(|p| p.declared.is_none())
    }

    /// One round over every backend of the undeclared pools; true when each one answered.
    pub async fn round(&self, connector: &Connector) -> bool {
        let asks = self
            .pools
            .all()
            .filter(|h| self.pools.fleet.pools[h.index].declared.is_none())
            .flat_map(|h| h.infos.values().cloned().collect::<Vec<_>>())
            .map(|info| async move {
                let body = crate::backend_http::get(
                    connector,
                    &info.name,
                    info.tls.as_ref(),
                    "/v1/models",
                    self.timeout,
                    MAX_MODELS_BYTES,
                )
                .await;
                (info.name.to_string(), body.and_then(|b| entries(&b)))
            });
        let answers = futures_util::future::join_all(asks).await;
        let all = answers.iter().all(|(_, r)| r.is_ok());
        let known: Vec<(String, Vec<serde_json::Value>)> = answers
            .into_iter()
            .filter_map(|(b, r)| match r {
                Ok(entries) => Some((b, entries)),
                Err(e) => {
                    log::debug!("model discovery: {b}: {e}");
                    None
                }
            })
            .collect();
        if let Some(routes) = self.pools.record_models(known) {
            log::info!(
                "{}",
                serde_json::json!({"event": "models_discovered", "generation": routes.generation,
                    "models": routes.models().collect::<Vec<_>>()})
            );
            (self.on_change)(routes);
        }
        all
    }
}

/// The `data` entries of an OpenAI `/v1/models` answer.
fn entries(body: &[u8]) -> Result<Vec<serde_json::Value>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(|d| d.as_array())
        .ok_or("no data list")?;
    Ok(data
        .iter()
        .filter(|e| e.get("id").and_then(|i| i.as_str()).is_some())
        .cloned()
        .collect())
}

#[async_trait]
impl BackgroundService for ModelDiscovery {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if !self.needed() {
            return;
        }
        let connector = Connector::new(None);
        loop {
            let answered = self.round(&connector).await;
            let wait = if answered { self.every } else { self.eager };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
