//! The retry budget of one pool (`routing.retry_budget`, Linkerd's by window): retries over the
//! last `window_ms` may be at most `ratio` of the requests first sent to the pool in that window,
//! or `min_retries`, whichever is more. So when every replica fails, the fleet sees at most
//! `1 + ratio` times the traffic instead of `1 + retries` times.
//!
//! The window is ten slots. Every request counts itself in its worker's own copy of the slots
//! (no cache line shared between cores on the request path); a retry, rare, sums the copies
//! under a lock.

use crate::worker_shard;
use sluice_config::RetryBudgetConfig;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

const SLOTS: usize = 10;

#[derive(Default)]
struct Slot {
    /// The slot's number + 1 (0: never used).
    at: AtomicU64,
    count: AtomicU64,
}

/// One worker's request counts, on lines of its own.
#[derive(Default)]
#[repr(align(64))]
struct Shard([Slot; SLOTS]);

impl Shard {
    fn add(&self, slot: u64) {
        let s = &self.0[(slot % SLOTS as u64) as usize];
        if s.at.load(Ordering::Relaxed) != slot + 1 {
            s.at.store(slot + 1, Ordering::Relaxed);
            s.count.store(0, Ordering::Relaxed);
        }
        s.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts of the slots inside the window ending at `slot`.
    fn sum(&self, slot: u64) -> u64 {
        self.0
            .iter()
            .filter(|s| {
                let at = s.at.load(Ordering::Relaxed);
                at > 0 && at - 1 + SLOTS as u64 > slot && at - 1 <= slot
            })
            .map(|s| s.count.load(Ordering::Relaxed))
            .sum()
    }
}

/// Whether a retry was allowed, and the window's figures when it was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetCheck {
    pub allowed: bool,
    pub requests: u64,
    /// Retries in the window, this one included when allowed.
    pub retries: u64,
    pub limit: u64,
}

pub struct RetryBudget {
    ratio: f64,
    min_retries: u64,
    slot_ms: u64,
    window_ms: u64,
    epoch: Instant,
    requests: Box<[Shard]>,
    retries: Mutex<Shard>,
}

impl RetryBudget {
    pub fn new(cfg: &RetryBudgetConfig) -> Self {
        RetryBudget {
            ratio: cfg.ratio,
            min_retries: u64::from(cfg.min_retries),
            slot_ms: (cfg.window_ms / SLOTS as u64).max(1),
            window_ms: cfg.window_ms,
            epoch: Instant::now(),
            requests: (0..worker_shard::COUNT).map(|_| Shard::default()).collect(),
            retries: Mutex::new(Shard::default()),
        }
    }

    fn slot(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64 / self.slot_ms
    }

    /// A request first sent to the pool.
    pub fn request(&self, now: Instant) {
        self.requests[worker_shard::index()].add(self.slot(now));
    }

    /// Spends one retry if the window allows it.
    pub fn try_retry(&self, now: Instant) -> BudgetCheck {
        let slot = self.slot(now);
        let retries = self.retries.lock().unwrap_or_else(|e| e.into_inner());
        let requests: u64 = self.requests.iter().map(|s| s.sum(slot)).sum();
        let spent = retries.sum(slot);
        let limit = ((self.ratio * requests as f64).floor() as u64).max(self.min_retries);
        let allowed = spent < limit;
        if allowed {
            retries.add(slot);
        }
        BudgetCheck {
            allowed,
            requests,
            retries: spent + u64::from(allowed),
            limit,
        }
    }

    /// The window's requests, retries and limit now, for `/status`.
    pub fn window(&self, now: Instant) -> BudgetCheck {
        let slot = self.slot(now);
        let spent = self
            .retries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sum(slot);
        let requests: u64 = self.requests.iter().map(|s| s.sum(slot)).sum();
        let limit = ((self.ratio * requests as f64).floor() as u64).max(self.min_retries);
        BudgetCheck {
            allowed: spent < limit,
            requests,
            retries: spent,
            limit,
        }
    }

    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn budget(ratio: f64, min_retries: u32) -> RetryBudget {
        RetryBudget::new(&RetryBudgetConfig {
            ratio,
            window_ms: 10_000,
            min_retries,
        })
    }

    #[test]
    fn retries_are_at_most_the_ratio_of_requests_or_the_minimum() {
        let b = budget(0.2, 3);
        let t = b.epoch;
        // No traffic yet: the minimum still lets a rare failure be retried.
        for _ in 0..3 {
            assert!(b.try_retry(t).allowed);
        }
        assert!(!b.try_retry(t).allowed);
        for _ in 0..100 {
            b.request(t);
        }
        let mut allowed = 0;
        for _ in 0..50 {
            allowed += u32::from(b.try_retry(t).allowed);
        }
        assert_eq!(allowed, 17, "20 of 100 requests, 3 already spent");
        let w = b.window(t);
        assert_eq!((w.requests, w.retries, w.limit), (100, 20, 20));
    }

    #[test]
    fn the_window_slides() {
        let b = budget(0.5, 0);
        let t = b.epoch;
        for _ in 0..10 {
            b.request(t);
        }
        for _ in 0..5 {
            assert!(b.try_retry(t).allowed);
        }
        assert!(!b.try_retry(t + Duration::from_millis(9_999)).allowed);
        // A slot later the first slot's requests and retries have left the window.
        let later = t + Duration::from_millis(10_000);
        assert_eq!(b.window(later).requests, 0);
        assert!(!b.try_retry(later).allowed, "no requests, no minimum");
        for _ in 0..4 {
            b.request(later);
        }
        assert!(b.try_retry(later).allowed);
        assert!(b.try_retry(later).allowed);
        assert!(!b.try_retry(later).allowed);
        // Requests spread over slots all count while inside the window.
        let c = budget(1.0, 0);
        for s in 0..10 {
            c.request(c.epoch + Duration::from_millis(s * 1000));
        }
        assert_eq!(
            c.window(c.epoch + Duration::from_millis(9_500)).requests,
            10
        );
        assert_eq!(
            c.window(c.epoch + Duration::from_millis(10_500)).requests,
            9
        );
    }

    #[test]
    fn a_zero_ratio_allows_only_the_minimum() {
        let b = budget(0.0, 1);
        for _ in 0..1000 {
            b.request(b.epoch);
        }
        assert!(b.try_retry(b.epoch).allowed);
        assert!(!b.try_retry(b.epoch).allowed);
    }
}
