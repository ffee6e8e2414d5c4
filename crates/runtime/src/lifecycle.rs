//! Where the process is in its life, shared by the request path (which counts itself in and
//! closes connections once another process takes over), the operations listener (`/readyz`)
//! and the drain service that ends the process.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

#[derive(Debug)]
pub struct Lifecycle {
    /// Requests between `new_ctx` and the end of `logging`, for the exact drain.
    active: Arc<ActiveRequests>,
    /// Flips to `true` when the process starts draining.
    draining: watch::Sender<bool>,
    /// Set from the moment another process is taking over the listeners (SIGQUIT) or the
    /// process drains: responses then close their connection, so clients reconnect to the new
    /// process instead of racing Pingora's close of idle keep-alive connections.
    closing: AtomicBool,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            active: Arc::default(),
            draining: watch::channel(false).0,
            closing: AtomicBool::new(false),
        }
    }
}

impl Lifecycle {
    /// Counts a request in until the returned guard is dropped.
    pub fn enter(&self) -> ActiveGuard {
        self.active.enter()
    }

    pub fn active(&self) -> usize {
        self.active.count()
    }

    pub fn closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }

    pub fn close_connections(&self) {
        self.closing.store(true, Ordering::Relaxed);
    }

    pub fn draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Marks the process draining: `/readyz` turns 503 and waiters for a slot are refused.
    pub fn start_draining(&self) {
        self.close_connections();
        let _ = self.draining.send(true);
    }

    /// Resolves once the process starts draining (a request waiting for a slot listens to it).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.draining.subscribe()
    }
}

/// Counts requests between `new_ctx` and the end of `logging` (the context's drop).
#[derive(Debug, Default)]
pub struct ActiveRequests(AtomicUsize);

impl ActiveRequests {
    fn enter(self: &Arc<Self>) -> ActiveGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        ActiveGuard(Arc::clone(self))
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Held by a request's context; the request stops counting when the context is dropped.
#[derive(Debug)]
pub struct ActiveGuard(Arc<ActiveRequests>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}
