//! The policy core: pure, deterministic, no I/O. Time is passed in as milliseconds on a monotonic
//! clock the caller owns, so one event model drives unit tests, the simulator and live runs alike.
//!
//! Two entry points:
//! - [`PolicyEngine::observe`] runs once per signal sample (a background tick). It evaluates each
//!   tier's pressure state through [`pressure`] and [`stability`] and advances the [`fallback`]
//!   tracker, producing an immutable [`PolicyState`].
//! - [`decide`] runs once per request against the latest [`PolicyState`]: [`tenant_policy`] turns
//!   the tier's state into a plan, [`action`] picks the intervention and [`routing`] picks the pool.

pub mod action;
pub mod adaptive;
mod adaptive_decide;
pub mod bucket;
pub mod ceiling;
pub mod clock;
mod engine;
pub mod fair;
pub mod fallback;
pub mod fleet;
pub mod pressure;
pub mod reason;
pub mod routing;
pub mod slo;
pub mod stability;
mod state;
pub mod tenant_policy;
pub mod tuning;
mod types;
pub mod work_gate;

pub use clock::Clock;
pub use engine::{decide, PolicyEngine};
pub use reason::Reason;
pub use state::{Decision, PolicyState};
pub use types::*;
