//! Per-request state carried through the Pingora phases. Dropping it (after `logging`) releases
//! the admission slot, so capacity is held until the last response byte or the client's exit.

use crate::shaping::{BodyFacts, Priority};
use bytes::{Bytes, BytesMut};
use sluice_config::tenancy::Identity;
use sluice_policy::{Decision, Reason};
use sluice_record::{Failure, Verdict};
use sluice_runtime::admission::Slot;
use std::time::{Duration, Instant};

/// How the request body reaches the upstream.
#[derive(Debug, Default, PartialEq, Eq)]
pub enum BodyMode {
    /// Forwarded as received (non-shapeable, or no rewrite needed).
    #[default]
    Passthrough,
    /// Read whole in `request_filter` (up to `limits.max_body_bytes`, to route by its model);
    /// `new_body` replaces it when rewritten.
    Preread,
    /// Too large to pre-read but needs a rewrite: buffered in `request_body_filter`, rewritten
    /// at end of stream and sent chunked.
    Buffered,
}

#[derive(Default)]
pub struct Ctx {
    pub started: Option<Instant>,
    pub received_at_ms: u64,
    pub request_id: String,
    pub identity: Option<Identity>,
    pub decision: Option<Decision>,
    /// What `decision` was decided on, for the record (and `sluice replay`).
    pub inputs: Option<sluice_record::PolicyInputs>,
    /// The final decision label and reason (queue and refusals override the policy's).
    pub label: Option<Verdict>,
    pub reason: Option<Reason>,
    pub slot: Option<Slot>,
    pub queued_for: Option<Duration>,
    pub body_mode: BodyMode,
    pub new_body: Option<Bytes>,
    /// The body as read in `request_filter` when it needs no rewrite: Sluice's own copy, sent on
    /// every attempt (a retry included) instead of Pingora's retry buffer.
    pub preread_body: Option<Bytes>,
    pub buffer: BytesMut,
    pub body_seen: usize,
    pub cap: Option<u32>,
    pub fallback_model: Option<String>,
    /// The pool serving the fallback model, when the decision moved the request there.
    pub fallback_pool: Option<usize>,
    /// What to do with the body's `priority` (the pool's `vllm_priority`).
    pub priority: Priority,
    pub facts: Option<BodyFacts>,
    pub applied_max_tokens: Option<i64>,
    /// The sample the request was decided on, with the routing table it was decided for.
    pub snapshot: Option<std::sync::Arc<sluice_runtime::signals::hub::Snapshot>>,
    /// The request's model's pools.
    pub route: Option<sluice_runtime::fleet::Route>,
    /// The pool the request goes to (index in the fleet) and its name.
    pub pool: Option<usize>,
    pub pool_label: Option<&'static str>,
    pub route_reason: Option<Reason>,
    pub backend: Option<std::sync::Arc<str>>,
    /// Counts the request in its backend's load until the context ends.
    pub lease: Option<sluice_runtime::fleet::Lease>,
    /// Sent to its prompt head's home by prefix affinity: its answer says whether the home kept
    /// the head.
    pub affinity: Option<sluice_runtime::pools::AffinityTicket>,
    /// The current backend's failures in a row and ejection, in its pool.
    pub passive: Option<std::sync::Arc<sluice_runtime::pools::Passive>>,
    /// Upstream attempts made (a retry after a failure before the first byte is one more).
    pub attempts: u8,
    /// The pool the first attempt went to: its `retries` and retry budget govern the request.
    pub home_pool: Option<usize>,
    /// The backends that failed before the current one, in order: never tried again.
    pub tried: Vec<std::sync::Arc<str>>,
    /// A retry granted in `upstream_response_filter` (a 502/503/504 answer), which
    /// `error_while_proxy` then carries out.
    pub retry_granted: bool,
    /// Why a failed attempt's answer went to the client instead of another replica: named in
    /// `x-sluice-retry-denied`, since the decision's reason says why it was admitted.
    pub retry_denied: Option<sluice_runtime::pools::RetryDenied>,
    pub overhead: Option<Duration>,
    pub first_byte: Option<Instant>,
    /// When the last response chunk went out: a stream's last token.
    pub last_byte: Option<Instant>,
    /// The objective this request is judged on: its tier's, tightened by its own headers.
    pub slo: sluice_policy::slo::Slo,
    pub response_tail: BytesMut,
    /// SSE events seen in a streamed response: its token count when it reports no usage.
    pub sse_events: u32,
    pub response_is_sse: bool,
    pub error: Option<Failure>,
    pub status: u16,
    /// The process is handing over or draining: close the connection after this response.
    pub closing: bool,
    /// Bytes and time to read and discard of a body left unread by a refusal, so the client
    /// sees the answer (limits.refused_body_drain_*).
    pub refused_body_drain: (usize, Duration),
    /// Counts this request as active until the context is dropped.
    pub active: Option<sluice_runtime::lifecycle::ActiveGuard>,
    /// Estimated prompt tokens (from the body's size), for the work gate.
    pub prompt_tokens: u64,
    /// Its work counted in flight on its pool until the context is dropped.
    pub work: Option<sluice_runtime::signals::hub::WorkCharge>,
    /// The tenant's budget check, when it has a budget: tier served as, rate-limit headers.
    pub quota: Option<sluice_runtime::quota::Ticket>,
    /// The request's spans, when tracing is on (the `spans` module starts and ends them).
    pub spans: Option<RequestSpans>,
}

/// A request's spans: its SERVER span, and the CLIENT span of the upstream attempt in progress.
#[derive(Debug)]
pub struct RequestSpans {
    pub server: sluice_trace::SpanBuilder,
    pub client: Option<sluice_trace::SpanBuilder>,
}
