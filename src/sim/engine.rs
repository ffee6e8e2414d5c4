//! The KV-cache and scheduling model of one vLLM engine.
//!
//! vLLM's scheduler only starts a sequence when it can hold the whole KV footprint it may need,
//! caps the running batch at `max_num_seqs`, and serves the waiting queue strictly in order, so
//! a large request at the head holds back smaller ones behind it. Latency grows with the share of
//! KV in use because bigger batches make every decode step slower. This module reproduces exactly
//! that, and nothing about HTTP.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

/// The numbers that shape admission and latency.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub kv_tokens: u64,
    pub max_running: usize,
    pub ttft_ms: f64,
    pub prefill_us_per_token: f64,
    pub itl_ms: f64,
    pub load_slowdown: f64,
}

/// A request whose KV need exceeds the whole budget: vLLM rejects these instead of queueing them
/// forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooLarge {
    pub need: u64,
    pub budget: u64,
}

/// A point-in-time view of the scheduler, for metrics and stats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_used: u64,
    pub kv_usage: f64,
    pub peak_running: usize,
    pub peak_in_flight: usize,
}

#[derive(Clone)]
pub(crate) struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: EngineConfig,
    state: Mutex<State>,
    /// Mirror of `State::kv_used` so per-token latency checks never contend on the lock.
    kv_used: AtomicU64,
}

#[derive(Default)]
struct State {
    running: usize,
    kv_used: u64,
    queue: VecDeque<Waiter>,
    next_ticket: u64,
    peak_running: usize,
    peak_in_flight: usize,
}

struct Waiter {
    ticket: u64,
    need: u64,
    wake: oneshot::Sender<()>,
}

/// Holds a running slot and its KV reservation; dropping it (request done, or the client went
/// away and the future was dropped) frees both and admits whoever is next.
pub(crate) struct Permit {
    inner: Arc<Inner>,
    need: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.inner.lock();
        self.inner.release(&mut st, self.need);
        self.inner.admit_waiters(&mut st);
    }
}

/// Cleans up a queued request whose future is dropped before it learns it was admitted.
struct Pending<'a> {
    inner: &'a Inner,
    ticket: u64,
    need: u64,
    armed: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.inner.lock();
        if let Some(pos) = st.queue.iter().position(|w| w.ticket == self.ticket) {
            st.queue.remove(pos);
        } else {
            // Only `admit_waiters` takes entries out of the queue besides us, so we were admitted
            // and the reservation is ours to give back.
            self.inner.release(&mut st, self.need);
        }
        // Leaving the head of the queue may unblock the requests behind us.
        self.inner.admit_waiters(&mut st);
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, and the counters stay usable even if it did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fits(&self, st: &State, need: u64) -> bool {
        st.running < self.cfg.max_running && st.kv_used.saturating_add(need) <= self.cfg.kv_tokens
    }

    fn take(&self, st: &mut State, need: u64) {
        st.running += 1;
        st.kv_used += need;
        st.peak_running = st.peak_running.max(st.running);
        st.peak_in_flight = st.peak_in_flight.max(st.running + st.queue.len());
        self.kv_used.store(st.kv_used, Ordering::Relaxed);
    }

    fn release(&self, st: &mut State, need: u64) {
        st.running = st.running.saturating_sub(1);
        st.kv_used = st.kv_used.saturating_sub(need);
        self.kv_used.store(st.kv_used, Ordering::Relaxed);
    }

    fn admit_waiters(&self, st: &mut State) {
        while let Some(head) = st.queue.front() {
            if !self.fits(st, head.need) {
                break;
            }
            let Some(w) = st.queue.pop_front() else { break };
            self.take(st, w.need);
            // A closed receiver means the waiter is being dropped; its `Pending` guard sees it is
            // no longer queued and gives the reservation back.
            let _ = w.wake.send(());
        }
    }
}

impl Engine {
    pub(crate) fn new(cfg: EngineConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                cfg,
                state: Mutex::new(State::default()),
                kv_used: AtomicU64::new(0),
            }),
        }
    }

    pub(crate) fn budget(&self) -> u64 {
        self.inner.cfg.kv_tokens
    }

    /// Waits (FIFO) until `need` KV tokens and a running slot are free, then holds them until the
    /// returned permit is dropped.
    pub(crate) async fn admit(&self, need: u64) -> Result<Permit, TooLarge> {
        let need = need.max(1);
        let budget = self.inner.cfg.kv_tokens;
        if need > budget {
            return Err(TooLarge { need, budget });
        }
        let (ticket, rx) = {
            let mut st = self.inner.lock();
            if st.queue.is_empty() && self.inner.fits(&st, need) {
                self.inner.take(&mut st, need);
                return Ok(self.permit(need));
            }
            let ticket = st.next_ticket;
            st.next_ticket += 1;
            let (wake, rx) = oneshot::channel();
            st.queue.push_back(Waiter { ticket, need, wake });
            st.peak_in_flight = st.peak_in_flight.max(st.running + st.queue.len());
            (ticket, rx)
        };
        let mut pending = Pending {
            inner: &self.inner,
            ticket,
            need,
            armed: true,
        };
        // The sender lives in the queue, which only `admit_waiters` drains (sending first) and we
        // keep the engine alive, so this resolves only on admission.
        let _ = rx.await;
        pending.armed = false;
        Ok(self.permit(need))
    }

    fn permit(&self, need: u64) -> Permit {
        Permit {
            inner: Arc::clone(&self.inner),
            need,
        }
    }

    pub(crate) fn kv_usage(&self) -> f64 {
        let budget = self.inner.cfg.kv_tokens.max(1) as f64;
        (self.inner.kv_used.load(Ordering::Relaxed) as f64 / budget).clamp(0.0, 1.0)
    }

    fn load_factor(&self) -> f64 {
        1.0 + self.inner.cfg.load_slowdown * self.kv_usage()
    }

    /// Prefill time at the current load (without any admin-injected delay).
    pub(crate) fn ttft(&self, prompt_tokens: u64) -> Duration {
        let cfg = &self.inner.cfg;
        let base = cfg.ttft_ms + prompt_tokens as f64 * cfg.prefill_us_per_token / 1000.0;
        ms_to_duration(base * self.load_factor())
    }

    /// One decode step at the current load.
    pub(crate) fn itl(&self) -> Duration {
        ms_to_duration(self.inner.cfg.itl_ms * self.load_factor())
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let st = self.inner.lock();
        Snapshot {
            running: st.running,
            waiting: st.queue.len(),
            kv_used: st.kv_used,
            kv_usage: self.kv_usage(),
            peak_running: st.peak_running,
            peak_in_flight: st.peak_in_flight,
        }
    }

    /// Restarts the high-water marks from the current load.
    pub(crate) fn reset_peaks(&self) {
        let mut st = self.inner.lock();
        st.peak_running = st.running;
        st.peak_in_flight = st.running + st.queue.len();
    }
}

/// Converts milliseconds to a `Duration` without the panics `from_secs_f64` has on odd input.
pub(crate) fn ms_to_duration(ms: f64) -> Duration {
    if !ms.is_finite() || ms <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(ms.min(1e12) / 1000.0).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(kv_tokens: u64, max_running: usize) -> Engine {
        Engine::new(EngineConfig {
            kv_tokens,
            max_running,
            ttft_ms: 20.0,
            prefill_us_per_token: 50.0,
            itl_ms: 1.0,
            load_slowdown: 3.0,
        })
    }

    async fn admitted_within(
        fut: impl std::future::Future<Output = Result<Permit, TooLarge>>,
    ) -> Option<Permit> {
        tokio::time::timeout(Duration::from_millis(20), fut)
            .await
            .ok()
            .map(|r| r.unwrap())
    }

    #[tokio::test]
    async fn kv_budget_blocks_and_drop_releases() {
        let e = engine(100, 8);
        let a = e.admit(60).await.unwrap();
        assert_eq!(e.snapshot().kv_used, 60);
        assert!(admitted_within(e.admit(60)).await.is_none());
        // The timed-out waiter must have left the queue.
        assert_eq!(e.snapshot().waiting, 0);
        drop(a);
        assert_eq!(e.snapshot().kv_used, 0);
        assert_eq!(e.snapshot().running, 0);
        let b = admitted_within(e.admit(100)).await;
        assert!(b.is_some());
        assert_eq!(e.kv_usage(), 1.0);
    }

    #[tokio::test]
    async fn max_running_limits_batch() {
        let e = engine(1000, 2);
        let _a = e.admit(1).await.unwrap();
        let b = e.admit(1).await.unwrap();
        assert!(admitted_within(e.admit(1)).await.is_none());
        drop(b);
        assert!(admitted_within(e.admit(1)).await.is_some());
        assert_eq!(e.snapshot().peak_running, 2);
    }

    #[tokio::test]
    async fn too_large_is_rejected() {
        let e = engine(100, 2);
        assert_eq!(
            e.admit(101).await.err(),
            Some(TooLarge {
                need: 101,
                budget: 100
            })
        );
    }

    #[tokio::test]
    async fn admission_is_strict_fifo() {
        let e = engine(100, 8);
        let first = e.admit(90).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        // A big request queues first; a small one that would fit must still wait behind it.
        for (name, need) in [("big", 50u64), ("small", 5u64)] {
            let e = e.clone();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let p = e.admit(need).await.unwrap();
                tx.send(name).unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(p);
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(e.snapshot().waiting, 2);
        assert!(rx.try_recv().is_err());
        drop(first);
        assert_eq!(rx.recv().await, Some("big"));
        assert_eq!(rx.recv().await, Some("small"));
        for t in tasks {
            t.await.unwrap();
        }
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting, s.kv_used), (0, 0, 0));
        assert_eq!(s.peak_in_flight, 3);
    }

    #[tokio::test]
    async fn dropped_head_unblocks_followers() {
        let e = engine(100, 8);
        let first = e.admit(60).await.unwrap();
        let e2 = e.clone();
        let head = tokio::spawn(async move { e2.admit(50).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(5)).await;
        let e3 = e.clone();
        let follower = tokio::spawn(async move {
            let p = e3.admit(30).await.unwrap();
            std::mem::forget(p);
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(e.snapshot().waiting, 2);
        head.abort();
        follower.await.unwrap();
        assert_eq!(e.snapshot().kv_used, 90);
        drop(first);
    }

    #[tokio::test]
    async fn latency_grows_with_usage() {
        let e = engine(100, 8);
        let idle_itl = e.itl();
        let idle_ttft = e.ttft(100);
        assert_eq!(idle_itl, Duration::from_millis(1));
        // 20 ms + 100 tokens * 50 us.
        assert_eq!(idle_ttft, Duration::from_millis(25));
        let p = e.admit(50).await.unwrap();
        assert_eq!(e.itl(), Duration::from_micros(2500));
        assert!(e.ttft(100) > idle_ttft);
        drop(p);
        assert_eq!(e.itl(), idle_itl);
    }

    #[test]
    fn odd_durations_do_not_panic() {
        assert_eq!(ms_to_duration(f64::NAN), Duration::ZERO);
        assert_eq!(ms_to_duration(-1.0), Duration::ZERO);
        assert!(ms_to_duration(f64::MAX) > Duration::ZERO);
    }
}
