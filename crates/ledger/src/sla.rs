//! The SLA-violation feedback signal: every few seconds, the share of completed proxied requests
//! in the ledger's sliding window that missed their tier's SLA target, fed to the policy.
//!
//! The policy's snapshot holds one `sla_violation_rate` per pool and compares it with *each*
//! tier's threshold, so the value fed is the fleet's rate — violations among completed proxied
//! requests of every tier, across every replica writing to this ledger — not one tier's. That is
//! deliberate: the rate is a capacity signal like KV pressure. Violations mean the shared
//! backends are too slow, whichever tier suffered them, and the per-tier thresholds already
//! encode who gives way first (Best-Effort sheds at 0.30, Standard degrades at 0.20, Guaranteed
//! only goes Elevated at 0.10). A per-tier feed would let a tier that is being shed look healthy
//! (it completes nothing, so it violates nothing) while the tier it protects keeps suffering; it
//! would also need a per-tier slot in the policy's snapshot. The per-tier breakdown is still
//! computed and shown in `/status` under `ledger[].sla.per_tier`.
//!
//! Rows without `sla_violated` (rejections, Sluice's own errors, failed upstreams) are not
//! completions and do not count. The window is measured on completion time.

use super::writer::{Ledger, SlaReport};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sluice_policy::SignalKind;
use sluice_runtime::signals::SignalHub;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub struct SlaService {
    pub ledger: Arc<Ledger>,
    pub hub: Arc<SignalHub>,
    /// How often the window is recomputed: well inside the hub's staleness bound.
    pub every: Duration,
    pub window: Duration,
    /// Only the newest N completions, when set.
    pub last_n: Option<u64>,
}

/// Recompute often enough that the hub never sees the value as stale (four times per staleness
/// bound), but at most every 100 ms and at least every 2 s: it is a query on every replica.
pub fn interval_for(stale_after_ms: u64) -> Duration {
    Duration::from_millis((stale_after_ms / 4).clamp(100, 2000))
}

impl SlaService {
    async fn compute(&self) -> Result<super::db::SlaWindow, String> {
        if !self.ledger.reachable() {
            return Err(format!("ledger unreachable: {}", self.ledger.last_error()));
        }
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let since = now_ms.saturating_sub(self.window.as_millis() as u64);
        let ledger = Arc::clone(&self.ledger);
        let last_n = self.last_n;
        tokio::task::spawn_blocking(move || ledger.db().sla_window(since, last_n))
            .await
            .map_err(|e| format!("ledger unreachable: {e}"))?
            .map_err(|e| format!("ledger unreachable: {e}"))
    }
}

#[async_trait]
impl BackgroundService for SlaService {
    async fn start(&self, _shutdown: ShutdownWatch) {
        // Runs through the grace period too: draining requests are still decided on it.
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let value = self.compute().await;
            self.hub.record_external_on_demand(
                SignalKind::SlaViolationRate,
                value.as_ref().map(|w| w.rate()).map_err(Clone::clone),
            );
            self.ledger.set_sla(SlaReport {
                at: Instant::now(),
                value,
            });
        }
    }
}
