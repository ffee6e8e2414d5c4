//! Signals: what the policy knows about the fleet. Two samplers feed [`SignalHub`]: the
//! [`scraper`] reads each backend's `/metrics` directly, the [`prometheus`] poller asks a
//! Prometheus server; `signals.source` picks one or both. The hub combines their samples with
//! admin overrides (overrides win) and staleness, and advances the pure
//! [`sluice_policy::PolicyEngine`] once per sample round, publishing an immutable
//! [`PolicyState`] the request path reads without locking.

pub mod health;
pub mod hub;
pub mod prometheus;
pub mod scraper;
pub mod vllm_text;

pub use hub::{SignalHub, SignalReading};
