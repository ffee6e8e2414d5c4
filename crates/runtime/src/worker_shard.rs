//! Per-worker shards of state every request writes (the decision ring, the connection guard's
//! stop signal, the work in flight, the request metrics): with one copy, both workers' cores
//! pulled its cache lines back and forth on every request. Each thread gets a shard index once,
//! in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards per kind of state: more than a proxy's worker threads, so each worker usually owns
/// one (two threads sharing one is still correct, only slower).
pub const COUNT: usize = 16;

/// This thread's shard index, handed out in turn on first use.
pub fn index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Ordering::Relaxed) % COUNT;
    }
    INDEX.with(|i| *i)
}
