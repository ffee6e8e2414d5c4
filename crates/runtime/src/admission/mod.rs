//! Admission: each tier's in-flight capacity (a hard bound in every pressure state) and the
//! bounded FIFO queue that queue-eligible tiers wait in when their capacity is full.
//!
//! An admitted request holds a [`Slot`]; dropping it releases the capacity. The proxy keeps the
//! slot in its per-request context, which lives until the response body (a whole SSE stream
//! included) has been sent or the client went away — not merely until headers were written.

mod build;
mod control;
mod credits;
mod local;
mod redis;

pub use self::redis::{RedisAdmission, RedisSettings};
pub use build::{build, Coordinator};
pub use control::*;
pub use local::LocalAdmission;
