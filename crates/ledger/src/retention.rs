//! Retention: deletes ledger rows older than `retention_days`, in small batches with a pause
//! between them, so the purge of a large backlog never holds locks the writer waits on; and the
//! SLA window's per-second counts once no window can reach them.

use super::writer::Ledger;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Rows per DELETE (per table).
pub const BATCH: i64 = 5000;
/// How long the SLA window's per-second counts (`sla_seconds`) are kept: a day and an hour.
pub const SLA_SECONDS_KEPT_MS: u64 = 90_000_000;
const EVERY: Duration = Duration::from_secs(600);
/// The first pass waits for startup (migrations, a spool replay) to settle.
const FIRST_AFTER: Duration = Duration::from_secs(60);
const PAUSE: Duration = Duration::from_millis(50);

pub struct Retention {
    pub ledger: Arc<Ledger>,
    pub days: u32,
}

impl Retention {
    async fn purge(&self) -> Result<u64, String> {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let cutoff = now_ms.saturating_sub(u64::from(self.days) * 86_400_000);
        // The SLA window's per-second counts are only read for the longest window there can be
        // (sla_window_seconds <= 86400, another replica's included), plus an hour of clock skew.
        let seconds_cutoff = now_ms.saturating_sub(SLA_SECONDS_KEPT_MS).max(cutoff);
        let ledger = Arc::clone(&self.ledger);
        tokio::task::spawn_blocking(move || ledger.db().delete_sla_seconds_before(seconds_cutoff))
            .await
            .map_err(|e| e.to_string())??;
        let mut total = 0;
        loop {
            let ledger = Arc::clone(&self.ledger);
            let deleted =
                tokio::task::spawn_blocking(move || ledger.db().delete_older_than(cutoff, BATCH))
                    .await
                    .map_err(|e| e.to_string())??;
            total += deleted;
            if deleted == 0 {
                return Ok(total);
            }
            tokio::time::sleep(PAUSE).await;
        }
    }
}

#[async_trait]
impl BackgroundService for Retention {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut wait = FIRST_AFTER;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
            wait = EVERY;
            if !self.ledger.reachable() {
                continue;
            }
            tokio::select! {
                r = self.purge() => match r {
                    Ok(0) => {}
                    Ok(n) => log::info!("{}", json!({"event": "ledger_retention", "deleted": n, "retention_days": self.days})),
                    Err(e) => log::warn!("{}", json!({"event": "ledger_retention_failed", "error": e})),
                },
                _ = shutdown.changed() => return,
            }
        }
    }
}
