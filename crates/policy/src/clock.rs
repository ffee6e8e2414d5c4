//! The monotonic clock the policy's `now` comes from. The core never reads it itself: callers
//! (the signal hub, the replay, the benchmark's model) pass its milliseconds in.

use crate::types::Millis;
use std::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    pub fn new() -> Self {
        Clock(Instant::now())
    }

    pub fn now_ms(&self) -> Millis {
        self.0.elapsed().as_millis() as Millis
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
