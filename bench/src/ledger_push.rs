//! `sluice-bench ledger-push`: the ledger sink's push from several request threads at once
//! while a writer thread takes a batch every millisecond, through Sluice's per-worker buffer
//! ([`sluice::ledger::buffer::Buffer`]) and through one mutex-guarded queue every thread shares
//! (the layout before it, with the same bound check and batch take). The records are built
//! before the clock starts. Wall time per push on each thread, best of three rounds.

use sluice::decisions::DecisionRecord;
use sluice::ledger::buffer::Buffer;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The writer's batch (the shipped `ledger.batch_rows`).
const BATCH: usize = 5_000;

trait Queue: Sync {
    fn push(&self, r: Arc<DecisionRecord>) -> bool;
    fn take(&self, n: usize) -> usize;
}

struct Shared {
    q: Mutex<VecDeque<Arc<DecisionRecord>>>,
    cap: usize,
}

impl Queue for Shared {
    fn push(&self, r: Arc<DecisionRecord>) -> bool {
        let mut q = self.q.lock().unwrap();
        if q.len() >= self.cap {
            return false;
        }
        q.push_back(r);
        true
    }
    fn take(&self, n: usize) -> usize {
        let rows: Vec<_> = {
            let mut q = self.q.lock().unwrap();
            let n = q.len().min(n);
            q.drain(..n).collect()
        };
        rows.len()
    }
}

impl Queue for Buffer {
    fn push(&self, r: Arc<DecisionRecord>) -> bool {
        Buffer::push(self, r).is_some()
    }
    fn take(&self, n: usize) -> usize {
        Buffer::take(self, n).len()
    }
}

pub fn run(threads: usize, per_thread: usize) {
    let cap = threads * per_thread;
    let time = |make: &dyn Fn() -> Box<dyn Queue>| {
        (0..3)
            .map(|_| {
                let q = make();
                let records: Vec<Vec<Arc<DecisionRecord>>> = (0..threads)
                    .map(|t| {
                        (0..per_thread)
                            .map(|i| {
                                Arc::new(DecisionRecord {
                                    request_id: format!("{t}-{i}"),
                                    received_at_ms: i as u64,
                                    ..Default::default()
                                })
                            })
                            .collect()
                    })
                    .collect();
                let pushing = AtomicBool::new(true);
                let elapsed = std::thread::scope(|s| {
                    let pushers: Vec<_> = records
                        .into_iter()
                        .map(|mine| {
                            let q = &q;
                            s.spawn(move || {
                                let start = Instant::now();
                                for r in mine {
                                    assert!(q.push(r), "the bench's buffer holds every record");
                                }
                                start.elapsed()
                            })
                        })
                        .collect();
                    s.spawn(|| {
                        while pushing.load(Ordering::Relaxed) {
                            q.take(BATCH);
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    });
                    let longest = pushers
                        .into_iter()
                        .map(|p| p.join().expect("pusher"))
                        .max()
                        .unwrap_or_default();
                    pushing.store(false, Ordering::Relaxed);
                    longest
                });
                elapsed.as_nanos() as f64 / per_thread as f64
            })
            .fold(f64::INFINITY, f64::min)
    };
    println!(
        "{threads} threads × {per_thread} pushes, a batch of {BATCH} taken every ms, ns per push on each thread (best of 3):"
    );
    println!(
        "  one shared queue    {:7.1}",
        time(&|| Box::new(Shared {
            q: Mutex::new(VecDeque::new()),
            cap
        }))
    );
    println!(
        "  per-worker queues   {:7.1}",
        time(&|| Box::new(Buffer::new(cap)))
    );
}
