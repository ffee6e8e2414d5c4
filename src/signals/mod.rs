//! Signals: what the policy knows about the fleet. The [`scraper`] background service samples
//! each pool's backends, [`SignalHub`] combines samples with admin overrides (overrides win) and
//! staleness, and advances the pure [`crate::policy::PolicyEngine`] once per sample, publishing an
//! immutable [`PolicyState`] the request path reads without locking.

pub mod hub;
pub mod scraper;
pub mod vllm_text;

pub use hub::{Clock, SignalHub, SignalReading};
