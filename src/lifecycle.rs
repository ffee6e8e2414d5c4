//! Process lifecycle beyond Pingora's: an exact graceful drain and hot reload.
//!
//! Pingora's graceful shutdown sleeps for the whole `grace_period_seconds` even when idle. The
//! [`DrainService`] sees the shutdown watch flip (SIGTERM, or the end of a SIGQUIT upgrade
//! handoff), marks the process draining (so `/readyz` turns 503 and queued requests get 503
//! `draining`), waits until no request is in flight — streams included — flushes the decision
//! sinks and exits; at the grace deadline Pingora's own shutdown takes over.
//!
//! The [`ReloadService`] re-reads the config file on SIGHUP and swaps tenants, API keys and tier
//! rules after validating the new file; an invalid file is refused with a log line naming file,
//! key and reason, and the old config stays in force.

use crate::config::Config;
use crate::proxy::App;
use crate::tenancy::TenantDirectory;
use async_trait::async_trait;
use pingora::server::{ExecutionPhase, ShutdownWatch};
use pingora::services::background::BackgroundService;
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts requests between `new_ctx` and the end of `logging` (the context's drop).
#[derive(Debug, Default)]
pub struct ActiveRequests(AtomicUsize);

impl ActiveRequests {
    pub fn enter(self: &Arc<Self>) -> ActiveGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        ActiveGuard(Arc::clone(self))
    }
    pub fn count(&self) -> usize {
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

pub struct DrainService {
    pub app: Arc<App>,
    pub grace: Duration,
    /// Pingora's execution phases: the upgrade handoff starts before the shutdown watch flips.
    pub phases: std::sync::Mutex<Option<tokio::sync::broadcast::Receiver<ExecutionPhase>>>,
}

impl DrainService {
    /// Marks the process closing as soon as Pingora starts handing its listeners over.
    fn watch_handover(&self) {
        let Some(mut phases) = self.phases.lock().ok().and_then(|mut p| p.take()) else {
            return;
        };
        let app = Arc::clone(&self.app);
        tokio::spawn(async move {
            while let Ok(phase) = phases.recv().await {
                if matches!(
                    phase,
                    ExecutionPhase::GracefulUpgradeTransferringFds
                        | ExecutionPhase::GracefulUpgradeCloseTimeout
                        | ExecutionPhase::GracefulTerminate
                ) {
                    app.closing.store(true, Ordering::Relaxed);
                    log::warn!(
                        "{}",
                        json!({"event": "closing_connections", "phase": format!("{phase:?}")})
                    );
                }
            }
        });
    }
}

#[async_trait]
impl BackgroundService for DrainService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        self.watch_handover();
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                return;
            }
        }
        let started = Instant::now();
        self.app.closing.store(true, Ordering::Relaxed);
        let _ = self.app.draining.send(true);
        log::warn!(
            "{}",
            json!({"event": "drain_started", "active_requests": self.app.active.count(), "grace_seconds": self.grace.as_secs()})
        );
        // Requests finishing right now still run `logging`; the settle time lets their records
        // reach the sinks before the final flush.
        while self.app.active.count() > 0 && started.elapsed() < self.grace {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let remaining = self.app.active.count();
        for sink in &self.app.sinks {
            sink.flush(Duration::from_secs(5)).await;
        }
        log::warn!(
            "{}",
            json!({"event": "drain_done", "remaining_requests": remaining, "seconds": started.elapsed().as_secs_f64()})
        );
        let _ =
            tokio::task::spawn_blocking(|| crate::log_writer::flush_stderr(Duration::from_secs(2)))
                .await;
        if remaining == 0 {
            // Nothing left to wait for: skip the rest of Pingora's fixed grace sleep.
            std::process::exit(0);
        }
    }
}

pub struct ReloadService {
    pub app: Arc<App>,
    pub path: PathBuf,
}

impl ReloadService {
    /// Validates the file and swaps what can change without a restart. Listeners, pools and
    /// coordinators are fixed for the process (use a binary upgrade to change them).
    pub fn reload(&self) -> Result<(), String> {
        let cfg = Config::load(&self.path).map_err(|e| e.to_string())?;
        // Renewed certificates first: a file that fails to load refuses the whole reload.
        for certs in &self.app.tls_certs {
            certs.reload()?;
        }
        self.app
            .tenants
            .store(Arc::new(TenantDirectory::from_config(&cfg)));
        self.app.hub.set_rules(cfg.policy_rules());
        self.app.quotas.configure(&cfg);
        self.app.config.store(Arc::new(cfg));
        Ok(())
    }
}

#[async_trait]
impl BackgroundService for ReloadService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                log::error!(
                    "{}",
                    json!({"event": "reload_unavailable", "error": e.to_string()})
                );
                return;
            }
        };
        loop {
            tokio::select! {
                _ = hup.recv() => match self.reload() {
                    Ok(()) => log::warn!("{}", json!({"event": "config_reloaded", "file": self.path.display().to_string()})),
                    Err(e) => log::error!("{}", json!({"event": "config_reload_refused", "error": e, "kept": "previous config"})),
                },
                _ = shutdown.changed() => return,
            }
        }
    }
}
