//! The decision record: one per request, with its reason, the signals it was decided on (and
//! every other policy input, for replay) and its outcome. Kept in an in-memory ring for
//! `/decisions/recent` and written as one JSON log line.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// The newest decisions in memory, for `/decisions/recent`.
///
/// Sharded by worker thread: with one lock, every request's push had both workers take the
/// same mutex and free records the other had allocated (mimalloc's cross-thread free), ~2.5 µs
/// of proxy CPU a request at 16 connections (bench/RESULTS.md, "Overhead at e7527d6"). A worker now locks its own shard, which only it
/// writes, and evicts its own records; a global sequence keeps the order across shards.
pub struct DecisionRing {
    cap: usize,
    next: AtomicU64,
    shards: Box<[Mutex<Shard>]>,
}

/// One worker's records, each with its place in the ring's global order.
type Shard = VecDeque<(u64, Arc<DecisionRecord>)>;

impl DecisionRing {
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        Self {
            cap,
            next: AtomicU64::new(0),
            shards: (0..crate::worker_shard::COUNT)
                .map(|_| Mutex::new(VecDeque::new()))
                .collect(),
        }
    }

    /// Each shard keeps up to `cap` records, so the newest `cap` overall are always held
    /// however unevenly the workers push; [`Self::recent`] reads only those.
    pub fn push(&self, r: Arc<DecisionRecord>) {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let evicted = {
            let mut items = self.shards[crate::worker_shard::index()]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let evicted = (items.len() >= self.cap).then(|| items.pop_front());
            items.push_back((seq, r));
            evicted
        };
        // Freed after the lock is released.
        drop(evicted);
    }

    /// Newest first, filtered, among the newest `cap` decisions.
    pub fn recent(&self, filter: &RecentFilter) -> Vec<Arc<DecisionRecord>> {
        let mut all: Vec<(u64, Arc<DecisionRecord>)> = Vec::new();
        for shard in &self.shards {
            let items = shard.lock().unwrap_or_else(|e| e.into_inner());
            all.extend(items.iter().cloned());
        }
        all.sort_unstable_by_key(|(seq, _)| std::cmp::Reverse(*seq));
        all.into_iter()
            .take(self.cap)
            .map(|(_, r)| r)
            .filter(|r| filter.matches(r))
            .take(filter.limit)
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

    /// Pushed from several threads (each its own shard), the ring still answers the newest
    /// `cap` decisions overall, newest first.
    #[test]
    fn ring_keeps_the_newest_across_threads() {
        let ring = Arc::new(DecisionRing::new(5));
        let mut pushed = 0;
        for round in 0..4 {
            // One thread per round, each pushing a different count: the shards fill unevenly.
            let ring = Arc::clone(&ring);
            let from = pushed;
            let n = 2 + round * 3;
            std::thread::spawn(move || {
                for i in from..from + n {
                    ring.push(Arc::new(DecisionRecord {
                        request_id: i.to_string(),
                        ..Default::default()
                    }));
                }
            })
            .join()
            .unwrap();
            pushed += n;
        }
        let ids: Vec<_> = ring
            .recent(&RecentFilter {
                limit: 100,
                ..Default::default()
            })
            .iter()
            .map(|r| r.request_id.parse::<usize>().unwrap())
            .collect();
        assert_eq!(ids, (pushed - 5..pushed).rev().collect::<Vec<_>>());
    }
}
