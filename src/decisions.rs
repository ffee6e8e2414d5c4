//! The decision record: one per request, with its reason, the signals it was decided on (and
//! every other policy input, for replay) and its outcome. Kept in an in-memory ring for
//! `/decisions/recent` and written as one JSON log line.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Where finished decision records go besides the in-memory ring (the PostgreSQL ledger).
/// `record` is called from Pingora's `logging` phase: it must never block or fail loudly — push
/// to a bounded buffer and return.
#[async_trait]
pub trait DecisionSink: Send + Sync {
    fn record(&self, record: Arc<DecisionRecord>);
    /// Health for `/status` (buffered, spooled, last flush, dropped …).
    fn status(&self) -> serde_json::Value;
    /// Called once when the process drains: persist what is buffered (to the database, or to
    /// local spool for the next start) within `timeout`.
    async fn flush(&self, _timeout: std::time::Duration) {}
}

/// Filters of `/decisions/recent`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecentFilter {
    pub tenant: Option<String>,
    pub tier: Option<String>,
    pub decision: Option<String>,
    /// Unix milliseconds; only records received at or after.
    pub since_ms: Option<u64>,
    pub limit: usize,
}

impl RecentFilter {
    pub fn matches(&self, r: &DecisionRecord) -> bool {
        self.tenant.as_deref().is_none_or(|t| r.tenant == t)
            && self.tier.as_deref().is_none_or(|t| r.tier == t)
            && self.decision.as_deref().is_none_or(|d| r.decision == d)
            && self.since_ms.is_none_or(|s| r.received_at_ms >= s)
    }
}

/// A durable store that can answer `/decisions/recent` (newest first).
#[async_trait]
pub trait DecisionQuery: Send + Sync {
    async fn recent(&self, filter: &RecentFilter) -> Result<Vec<serde_json::Value>, String>;
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SignalsUsed {
    pub pressure: Option<f64>,
    pub queue_depth: Option<f64>,
    pub sla_violation_rate: Option<f64>,
}

/// A field whose value is usually one of the program's own names (a tier, a decision, a
/// reason): borrowed then, so a record costs no allocation per such field; owned when read back
/// from the spool or the database.
pub type Text = std::borrow::Cow<'static, str>;

/// Owned and deserialisable: the same type is the ledger's row, its spool line and the answer of
/// `/decisions/recent`. `#[serde(default)]` lets a spool written by an older build (fewer
/// fields) still be replayed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionRecord {
    pub request_id: String,
    /// Unix time in milliseconds.
    pub received_at_ms: u64,
    pub replica: Text,
    pub tenant: String,
    pub tier: Text,
    pub method: Text,
    pub path: Text,
    /// pass, degrade, queue, fallback, reject, or error (Sluice could not proxy).
    pub decision: Text,
    pub reason: Text,
    pub state: Text,
    pub pool: Option<Text>,
    pub route_reason: Option<Text>,
    pub backend: Option<std::sync::Arc<str>>,
    pub requested_model: Option<String>,
    pub routed_model: Option<String>,
    pub requested_max_tokens: Option<i64>,
    pub applied_max_tokens: Option<i64>,
    pub stream: bool,
    pub queue_wait_ms: Option<f64>,
    pub status: u16,
    pub latency_ms: f64,
    pub ttfb_ms: Option<f64>,
    pub overhead_us: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub sla_target_ms: Option<u64>,
    pub sla_violated: Option<bool>,
    pub signals: SignalsUsed,
    /// queue_released, queue_timed_out or queue_dropped when the request met the queue.
    pub queue_outcome: Option<String>,
    /// client_gone, upstream_error, upstream_timeout, connect_error, or Sluice's own refusal.
    pub error: Option<String>,
    /// What the policy decided on, so `sluice replay` can decide it again; `None` when the
    /// request was refused before the policy ran.
    #[serde(deserialize_with = "crate::replay::input::lenient")]
    pub inputs: Option<crate::replay::PolicyInputs>,
}

pub struct DecisionRing {
    cap: usize,
    items: Mutex<VecDeque<Arc<DecisionRecord>>>,
}

impl DecisionRing {
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            items: Mutex::new(VecDeque::with_capacity(cap.clamp(1, 4096))),
        }
    }

    pub fn push(&self, r: Arc<DecisionRecord>) {
        let mut items = self.items.lock().unwrap_or_else(|e| e.into_inner());
        if items.len() == self.cap {
            items.pop_front();
        }
        items.push_back(r);
    }

    /// Newest first, filtered.
    pub fn recent(&self, filter: &RecentFilter) -> Vec<Arc<DecisionRecord>> {
        let items = self.items.lock().unwrap_or_else(|e| e.into_inner());
        items
            .iter()
            .rev()
            .filter(|r| filter.matches(r))
            .take(filter.limit)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest() {
        let ring = DecisionRing::new(3);
        for i in 0..5 {
            ring.push(Arc::new(DecisionRecord {
                request_id: i.to_string(),
                ..Default::default()
            }));
        }
        let all = |limit| RecentFilter {
            limit,
            ..Default::default()
        };
        let ids: Vec<_> = ring
            .recent(&all(10))
            .iter()
            .map(|r| r.request_id.clone())
            .collect();
        assert_eq!(ids, ["4", "3", "2"]);
        assert_eq!(ring.recent(&all(1)).len(), 1);
    }
}
