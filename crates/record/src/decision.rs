//! The decision record: one per request, with its reason, the signals it was decided on (and
//! every other policy input, for replay) and its outcome; and the two interfaces it leaves
//! through, a durable sink and a query for `/decisions/recent`.

use crate::outcome::{Failure, QueueOutcome, Verdict};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Where finished decision records go besides the in-memory ring (the PostgreSQL ledger).
/// `record` is called from Pingora's `logging` phase: it must never block or fail loudly — push
/// to a bounded buffer and return.
#[async_trait]
pub trait DecisionSink: Send + Sync {
    fn record(&self, record: Arc<DecisionRecord>);
    /// The sink's own status for `/status` (buffered, spooled, last flush, dropped …),
    /// serialised from its typed form: `/status` only passes it through.
    fn status(&self) -> serde_json::Value;
    /// Whether the sink's store is reachable now; `None` for a sink without one.
    fn healthy(&self) -> Option<bool> {
        None
    }
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
            && self
                .decision
                .as_deref()
                .is_none_or(|d| r.decision.as_str() == d)
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
    pub decision: Verdict,
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
    /// The tier's end-to-end target (`sla_target_ms`, `slo.e2e_ms`), when it sets one.
    pub sla_target_ms: Option<u64>,
    /// The request missed a dimension of its objective; `None` when it was not judged
    /// (refused, failed, or no dimension applies).
    pub sla_violated: Option<bool>,
    /// A streamed answer's time to first token (from receipt, Sluice's queue included).
    pub ttft_ms: Option<f64>,
    /// A streamed answer's time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// The TTFT and TPOT targets it was judged on (its tier's, or tighter ones it asked for).
    pub ttft_target_ms: Option<u64>,
    pub tpot_target_ms: Option<u64>,
    /// The dimensions it missed: `ttft`, `tpot`, `e2e`, comma-separated.
    pub slo_missed: Option<Text>,
    /// Upstream attempts made, when it was sent: more than 1 when it failed over before its
    /// first byte.
    pub attempts: Option<u64>,
    /// The replicas that failed it before the one that answered, comma-separated.
    pub tried: Option<Text>,
    /// Its W3C trace id (32 hex digits), when it was traced.
    pub trace_id: Option<Text>,
    pub signals: SignalsUsed,
    /// How its wait ended, when the request met the tier's queue.
    pub queue_outcome: Option<QueueOutcome>,
    /// Why it did not complete, when it was admitted and failed.
    pub error: Option<Failure>,
    /// What the policy decided on, so `sluice replay` can decide it again; `None` when the
    /// request was refused before the policy ran.
    #[serde(deserialize_with = "crate::inputs::lenient")]
    pub inputs: Option<crate::inputs::PolicyInputs>,
}

/// A queue lifecycle event derived from a row (`queue_queued`, `queue_released`,
/// `queue_timed_out`, `queue_dropped`).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueEvent {
    pub event: &'static str,
    /// Unix ms when it happened: arrival for `queue_queued` and `queue_dropped`, arrival plus the
    /// wait for the end of a wait.
    pub at_ms: u64,
    pub wait_ms: Option<f64>,
}

impl DecisionRecord {
    /// When the response finished, the time the SLA window is measured on: a long stream counts
    /// when it ends, not when it arrived.
    pub fn completed_at_ms(&self) -> u64 {
        let latency = if self.latency_ms.is_finite() && self.latency_ms > 0.0 {
            self.latency_ms.round() as u64
        } else {
            0
        };
        self.received_at_ms.saturating_add(latency)
    }

    /// The queue events this request went through. A drop happens on arrival (queue full), so it
    /// has no `queue_queued`; a wait that ended has both its start and its end.
    pub fn queue_events(&self) -> Vec<QueueEvent> {
        let outcome = self.queue_outcome;
        let event = |event, at_ms, wait_ms| QueueEvent {
            event,
            at_ms,
            wait_ms,
        };
        let end = outcome.unwrap_or(QueueOutcome::Released).as_str();
        match (outcome, self.queue_wait_ms) {
            (None, None) => Vec::new(),
            (_, Some(w)) => {
                let waited = if w.is_finite() && w > 0.0 {
                    w.round() as u64
                } else {
                    0
                };
                vec![
                    event("queue_queued", self.received_at_ms, None),
                    event(end, self.received_at_ms.saturating_add(waited), Some(w)),
                ]
            }
            (Some(_), None) => vec![event(end, self.received_at_ms, None)],
        }
    }
}
