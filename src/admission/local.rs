//! The in-process coordinator: exact within one replica. A released slot is handed directly to
//! the head of the tier's queue (FIFO), so waiters are woken rather than polling.

use super::{Admission, AdmissionControl, QueueParams, Slot, TierAdmission};
use crate::policy::{Reason, Tier};
use async_trait::async_trait;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::oneshot;

#[derive(Default)]
struct TierSlots {
    inflight: u64,
    capacity: u32,
    next_waiter: u64,
    /// The slot itself travels through the channel: if the waiter has gone (client hung up),
    /// dropping the undelivered slot releases it again, so capacity cannot leak.
    waiters: VecDeque<(u64, oneshot::Sender<Slot>)>,
}

#[derive(Default)]
struct Inner {
    tiers: [Mutex<TierSlots>; 3],
}

impl Inner {
    fn lock(&self, tier: Tier) -> MutexGuard<'_, TierSlots> {
        // A poisoned lock only means another thread panicked mid-update of plain counters;
        // keep serving rather than cascading the panic onto the request path.
        self.tiers[tier.index()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn slot(self: &Arc<Self>, tier: Tier) -> Slot {
        let inner = Arc::clone(self);
        Slot::new(move || inner.release(tier))
    }

    fn release(self: &Arc<Self>, tier: Tier) {
        loop {
            let waiter = {
                let mut t = self.lock(tier);
                let over = t.capacity != 0 && t.inflight > u64::from(t.capacity);
                match t.waiters.pop_front() {
                    Some((_, tx)) if !over => tx,
                    other => {
                        if let Some(w) = other {
                            t.waiters.push_front(w);
                        }
                        t.inflight = t.inflight.saturating_sub(1);
                        return;
                    }
                }
            };
            match waiter.send(self.slot(tier)) {
                Ok(()) => return,
                // The waiter is gone: take the slot back (without releasing) and try the next.
                Err(slot) => slot.disarm(),
            }
        }
    }
}

#[derive(Default, Clone)]
pub struct LocalAdmission {
    inner: Arc<Inner>,
}

impl LocalAdmission {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl AdmissionControl for LocalAdmission {
    async fn admit(&self, tier: Tier, capacity: u32, queue: Option<QueueParams>) -> Admission {
        let started = Instant::now();
        let (id, rx, max_wait) = {
            let mut t = self.inner.lock(tier);
            t.capacity = capacity;
            if capacity == 0 || (t.inflight < u64::from(capacity) && t.waiters.is_empty()) {
                t.inflight += 1;
                drop(t);
                return Admission::Admitted {
                    slot: self.inner.slot(tier),
                    queued_for: None,
                    fail_open: false,
                };
            }
            let Some(q) = queue else {
                return Admission::Refused {
                    reason: Reason::TierAtCapacity,
                    queued_for: None,
                };
            };
            if t.waiters.len() >= q.max_size {
                return Admission::Refused {
                    reason: Reason::QueueDropped,
                    queued_for: None,
                };
            }
            let (tx, rx) = oneshot::channel();
            t.next_waiter += 1;
            let id = t.next_waiter;
            t.waiters.push_back((id, tx));
            (id, rx, q.max_wait)
        };
        let mut rx = rx;
        let slot = match tokio::time::timeout(max_wait, &mut rx).await {
            Ok(Ok(slot)) => Some(slot),
            _ => {
                let still_queued = {
                    let mut t = self.inner.lock(tier);
                    let before = t.waiters.len();
                    t.waiters.retain(|(w, _)| *w != id);
                    t.waiters.len() != before
                };
                // Not in the queue any more: a slot was handed over just as the deadline hit.
                if still_queued {
                    None
                } else {
                    rx.await.ok()
                }
            }
        };
        let queued_for = Some(started.elapsed());
        match slot {
            Some(slot) => Admission::Admitted {
                slot,
                queued_for,
                fail_open: false,
            },
            None => Admission::Refused {
                reason: Reason::QueueTimedOut,
                queued_for,
            },
        }
    }

    fn status(&self, tier: Tier) -> TierAdmission {
        let t = self.inner.lock(tier);
        TierAdmission {
            inflight: t.inflight,
            queued: t.waiters.len() as u64,
            capacity: t.capacity,
        }
    }

    fn kind(&self) -> &'static str {
        "local"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn q(max_size: usize, wait_ms: u64) -> Option<QueueParams> {
        Some(QueueParams {
            max_size,
            max_wait: Duration::from_millis(wait_ms),
            poll: Duration::from_millis(50),
        })
    }

    fn admitted(a: Admission) -> Slot {
        match a {
            Admission::Admitted { slot, .. } => slot,
            Admission::Refused { reason, .. } => panic!("refused: {reason:?}"),
        }
    }

    fn refused(a: Admission) -> Reason {
        match a {
            Admission::Refused { reason, .. } => reason,
            Admission::Admitted { .. } => panic!("admitted"),
        }
    }

    #[tokio::test]
    async fn capacity_is_a_hard_bound_and_slots_release_on_drop() {
        let a = LocalAdmission::new();
        let s1 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        let _s2 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        assert_eq!(
            refused(a.admit(Tier::Guaranteed, 2, None).await),
            Reason::TierAtCapacity
        );
        assert_eq!(a.status(Tier::Guaranteed).inflight, 2);
        drop(s1);
        assert_eq!(a.status(Tier::Guaranteed).inflight, 1);
        let _s3 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        assert_eq!(
            a.status(Tier::Standard).inflight,
            0,
            "tiers are independent"
        );
    }

    #[tokio::test]
    async fn queue_releases_in_fifo_order() {
        let a = LocalAdmission::new();
        let held = admitted(a.admit(Tier::Standard, 1, None).await);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let a = a.clone();
            let done = done_tx.clone();
            tokio::spawn(async move {
                let slot = admitted(a.admit(Tier::Standard, 1, q(10, 5000)).await);
                done.send(i).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(slot);
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(a.status(Tier::Standard).queued, 3);
        drop(held);
        let order: Vec<i32> = vec![
            done_rx.recv().await.unwrap(),
            done_rx.recv().await.unwrap(),
            done_rx.recv().await.unwrap(),
        ];
        assert_eq!(order, vec![0, 1, 2]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            a.status(Tier::Standard),
            TierAdmission {
                inflight: 0,
                queued: 0,
                capacity: 1
            }
        );
    }

    #[tokio::test]
    async fn queue_bound_and_deadline() {
        let a = LocalAdmission::new();
        let _held = admitted(a.admit(Tier::Standard, 1, None).await);
        let a2 = a.clone();
        let waiter =
            tokio::spawn(async move { refused(a2.admit(Tier::Standard, 1, q(1, 100)).await) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            refused(a.admit(Tier::Standard, 1, q(1, 100)).await),
            Reason::QueueDropped
        );
        assert_eq!(waiter.await.unwrap(), Reason::QueueTimedOut);
        assert_eq!(
            a.status(Tier::Standard).queued,
            0,
            "timed-out entries are removed"
        );
        assert_eq!(a.status(Tier::Standard).inflight, 1);
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_does_not_leak_the_slot() {
        let a = LocalAdmission::new();
        let held = admitted(a.admit(Tier::Standard, 1, None).await);
        let a2 = a.clone();
        let gone = tokio::spawn(async move { a2.admit(Tier::Standard, 1, q(5, 5000)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        assert_eq!(a.status(Tier::Standard).inflight, 0);
        assert_eq!(a.status(Tier::Standard).queued, 0);
    }

    #[tokio::test]
    async fn unlimited_capacity_still_counts() {
        let a = LocalAdmission::new();
        let slots: Vec<_> = futures_join(&a, 50).await;
        assert_eq!(a.status(Tier::BestEffort).inflight, 50);
        drop(slots);
        assert_eq!(a.status(Tier::BestEffort).inflight, 0);
    }

    async fn futures_join(a: &LocalAdmission, n: usize) -> Vec<Slot> {
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(admitted(a.admit(Tier::BestEffort, 0, None).await));
        }
        v
    }
}
