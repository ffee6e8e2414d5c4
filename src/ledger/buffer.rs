//! The ledger's bounded buffer: decision records pushed by the request threads and not yet
//! taken by the writer (or a spill).
//!
//! One queue per worker shard ([`crate::worker_shard`]), like the decision ring: with a single
//! mutex every request on every worker took the same lock and wrote the same queue, and the
//! writer held it while it took a batch of thousands. A push now locks only its own worker's
//! queue, which no other request thread touches; what all of them still share is one counter,
//! the buffer's bound.

use crate::decisions::DecisionRecord;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

type Queue = VecDeque<Arc<DecisionRecord>>;

pub struct Buffer {
    shards: Box<[Mutex<Queue>]>,
    /// Rows pushed and not yet taken. Raised before a row enters its queue and lowered after
    /// rows leave one, so it is never below what the queues hold.
    len: AtomicUsize,
    cap: usize,
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Buffer {
    pub fn new(cap: usize) -> Self {
        Self {
            shards: (0..crate::worker_shard::COUNT)
                .map(|_| Mutex::new(VecDeque::new()))
                .collect(),
            len: AtomicUsize::new(0),
            cap,
        }
    }

    /// Keeps the record and returns the rows buffered with it, or `None` when the buffer is
    /// full (the record is not kept).
    pub fn push(&self, record: Arc<DecisionRecord>) -> Option<usize> {
        self.push_on(crate::worker_shard::index(), record)
    }

    fn push_on(&self, shard: usize, record: Arc<DecisionRecord>) -> Option<usize> {
        let len = self.len.fetch_add(1, Ordering::AcqRel) + 1;
        if len > self.cap {
            self.len.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        lock(&self.shards[shard % self.shards.len()]).push_back(record);
        Some(len)
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes up to `n` rows, the oldest of each queue, every queue giving its share of the
    /// batch; returned in arrival order, so a batch or a spill writes rows as they came even
    /// when several workers pushed them.
    pub fn take(&self, n: usize) -> Vec<Arc<DecisionRecord>> {
        let lens: Vec<usize> = self.shards.iter().map(|s| lock(s).len()).collect();
        let total: usize = lens.iter().sum();
        let mut out = Vec::with_capacity(total.min(n));
        for (shard, &len) in self.shards.iter().zip(&lens) {
            if len == 0 || out.len() == n {
                continue;
            }
            // Rounded up, so the shares reach `n`; the last queues give what is left.
            let share = if total <= n {
                len
            } else {
                (len * n).div_ceil(total)
            };
            let mut q = lock(shard);
            let k = share.min(n - out.len()).min(q.len());
            out.extend(q.drain(..k));
        }
        self.len.fetch_sub(out.len(), Ordering::AcqRel);
        // Stable: rows of one millisecond keep each queue's order.
        out.sort_by_key(|r| r.received_at_ms);
        out
    }

    /// Everything buffered, in arrival order.
    pub fn take_all(&self) -> Vec<Arc<DecisionRecord>> {
        self.take(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, at: u64) -> Arc<DecisionRecord> {
        Arc::new(DecisionRecord {
            request_id: format!("r{id}"),
            received_at_ms: at,
            ..Default::default()
        })
    }

    fn ids(rows: &[Arc<DecisionRecord>]) -> Vec<&str> {
        rows.iter().map(|r| r.request_id.as_str()).collect()
    }

    #[test]
    fn a_full_buffer_refuses_and_taking_makes_room() {
        let b = Buffer::new(3);
        assert_eq!(b.push(rec(1, 1)), Some(1));
        assert_eq!(b.push(rec(2, 2)), Some(2));
        assert_eq!(b.push(rec(3, 3)), Some(3));
        assert_eq!(b.push(rec(4, 4)), None);
        assert_eq!(b.len(), 3);
        assert_eq!(ids(&b.take(2)), ["r1", "r2"]);
        assert_eq!(b.push(rec(5, 5)), Some(2));
        assert_eq!(ids(&b.take_all()), ["r3", "r5"]);
        assert!(b.is_empty());
    }

    #[test]
    fn rows_pushed_by_several_workers_come_out_in_arrival_order_and_each_once() {
        let b = Arc::new(Buffer::new(100_000));
        let threads = 4;
        let per = 5_000;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    for i in 0..per {
                        let id = t * per + i;
                        // Interleaved arrival times across the threads.
                        b.push(rec(id, (i * threads + t) as u64)).unwrap();
                    }
                })
            })
            .collect();
        let mut seen = Vec::new();
        loop {
            let done = handles.iter().all(|h| h.is_finished());
            let batch = b.take(1_000);
            assert!(batch.len() <= 1_000);
            let times: Vec<u64> = batch.iter().map(|r| r.received_at_ms).collect();
            assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
            seen.extend(batch.iter().map(|r| r.request_id.clone()));
            if done && b.is_empty() {
                break;
            }
        }
        for h in handles {
            h.join().unwrap();
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), threads * per);
        assert!(b.is_empty());
    }

    #[test]
    fn a_batch_takes_the_oldest_of_every_workers_rows() {
        let b = Buffer::new(1_000);
        // Two workers' queues: one with rows 0..6, the other with rows 100..102.
        for i in 0..6 {
            b.push_on(0, rec(i, i as u64)).unwrap();
        }
        for i in 100..102 {
            b.push_on(1, rec(i, i as u64)).unwrap();
        }
        // 4 of 8: three of the first queue's six and one of the second's two.
        assert_eq!(ids(&b.take(4)), ["r0", "r1", "r2", "r100"]);
        assert_eq!(b.len(), 4);
    }
}
