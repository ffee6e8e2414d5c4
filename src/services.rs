//! The process's own services beyond Pingora's: an exact graceful drain, hot reload and the
//! trace exporter.
//!
//! Pingora's graceful shutdown sleeps for the whole `grace_period_seconds` even when idle. The
//! [`DrainService`] sees the shutdown watch flip (SIGTERM, or the end of a SIGQUIT upgrade
//! handoff), marks the process draining (so `/readyz` turns 503 and queued requests get 503
//! `draining`), waits until no request is in flight — streams included — flushes the decision
//! sinks and tells `main` ([`Drained`]), which may end the process early; at the grace
//! deadline Pingora's own shutdown takes over.
//!
//! The [`ReloadService`] re-reads the config file on SIGHUP and swaps tenants, API keys, tier
//! rules, quotas and the TLS listeners' certificates after validating the new file; an invalid
//! file is refused with a log line naming file, key and reason, and the old config stays.

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::{ExecutionPhase, ShutdownWatch};
use pingora::services::background::BackgroundService;
use serde_json::json;
use sluice_config::tenancy::TenantDirectory;
use sluice_config::tls::CertStore;
use sluice_config::Config;
use sluice_record::DecisionSink;
use sluice_runtime::lifecycle::Lifecycle;
use sluice_runtime::quota::Quotas;
use sluice_runtime::signals::SignalHub;
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, watch};

/// Sends the request path's finished spans to the collector ([`sluice_trace::Exporter`]):
/// batched, each export bounded, off the request path. It outlives Pingora's shutdown signal
/// until the drain is done ([`TraceFlush`]), so the spans of requests that finish while the
/// process drains are sent too; then what is queued gets one last attempt.
pub struct TraceExportService {
    exporter: Mutex<Option<sluice_trace::Exporter>>,
    stop: watch::Receiver<bool>,
    finished: watch::Sender<bool>,
}

/// The drain's end of the exporter: stops it once nothing is in flight, and waits (bounded) for
/// its last export.
pub struct TraceFlush {
    stop: watch::Sender<bool>,
    finished: watch::Receiver<bool>,
}

impl TraceFlush {
    async fn flush(&self, within: Duration) {
        self.stop.send_replace(true);
        let mut finished = self.finished.clone();
        let _ = tokio::time::timeout(within, finished.wait_for(|done| *done)).await;
    }
}

/// The exporter's service and the drain's handle on it.
pub fn trace_export(exporter: sluice_trace::Exporter) -> (TraceExportService, TraceFlush) {
    let (stop, stop_rx) = watch::channel(false);
    let (finished, finished_rx) = watch::channel(false);
    let service = TraceExportService {
        exporter: Mutex::new(Some(exporter)),
        stop: stop_rx,
        finished,
    };
    (
        service,
        TraceFlush {
            stop,
            finished: finished_rx,
        },
    )
}

#[async_trait]
impl BackgroundService for TraceExportService {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let exporter = self.exporter.lock().ok().and_then(|mut e| e.take());
        if let Some(exporter) = exporter {
            exporter.run(self.stop.clone()).await;
        }
        self.finished.send_replace(true);
    }
}

/// Hears once, when the drain has finished with nothing left in flight.
pub type Drained = mpsc::Receiver<()>;

pub struct DrainService {
    lifecycle: Arc<Lifecycle>,
    sinks: Arc<[Arc<dyn DecisionSink>]>,
    grace: Duration,
    /// Pingora's execution phases: the upgrade handoff starts before the shutdown watch flips.
    phases: Mutex<Option<broadcast::Receiver<ExecutionPhase>>>,
    done: mpsc::Sender<()>,
    /// The trace exporter, stopped after the last request in flight has ended.
    trace: Option<TraceFlush>,
}

impl DrainService {
    pub fn new(
        lifecycle: Arc<Lifecycle>,
        sinks: Arc<[Arc<dyn DecisionSink>]>,
        grace: Duration,
        phases: broadcast::Receiver<ExecutionPhase>,
        trace: Option<TraceFlush>,
    ) -> (Self, Drained) {
        let (done, drained) = mpsc::channel();
        let service = Self {
            lifecycle,
            sinks,
            grace,
            phases: Mutex::new(Some(phases)),
            done,
            trace,
        };
        (service, drained)
    }

    /// Marks the process closing as soon as Pingora starts handing its listeners over.
    fn watch_handover(&self) {
        let Some(mut phases) = self.phases.lock().ok().and_then(|mut p| p.take()) else {
            return;
        };
        let lifecycle = Arc::clone(&self.lifecycle);
        tokio::spawn(async move {
            while let Ok(phase) = phases.recv().await {
                if matches!(
                    phase,
                    ExecutionPhase::GracefulUpgradeTransferringFds
                        | ExecutionPhase::GracefulUpgradeCloseTimeout
                        | ExecutionPhase::GracefulTerminate
                ) {
                    lifecycle.close_connections();
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
        self.lifecycle.start_draining();
        log::warn!(
            "{}",
            json!({"event": "drain_started", "active_requests": self.lifecycle.active(), "grace_seconds": self.grace.as_secs()})
        );
        // Requests finishing right now still run `logging`; the settle time lets their records
        // reach the sinks before the final flush.
        while self.lifecycle.active() > 0 && started.elapsed() < self.grace {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let remaining = self.lifecycle.active();
        for sink in self.sinks.iter() {
            sink.flush(Duration::from_secs(5)).await;
        }
        if let Some(trace) = &self.trace {
            trace.flush(Duration::from_secs(3)).await;
        }
        log::warn!(
            "{}",
            json!({"event": "drain_done", "remaining_requests": remaining, "seconds": started.elapsed().as_secs_f64()})
        );
        let _ = tokio::task::spawn_blocking(|| {
            sluice_runtime::log_writer::flush_stderr(Duration::from_secs(2))
        })
        .await;
        if remaining == 0 {
            // Nothing left to wait for: `main` may skip the rest of Pingora's grace sleep.
            let _ = self.done.send(());
        }
    }
}

/// What a SIGHUP may change without a restart. Listeners, pools and coordinators are fixed for
/// the process (a binary upgrade changes them).
pub struct ReloadService {
    pub path: PathBuf,
    pub config: Arc<ArcSwap<Config>>,
    pub tenants: Arc<ArcSwap<TenantDirectory>>,
    pub hub: Arc<SignalHub>,
    pub quotas: Arc<Quotas>,
    pub tls_certs: Vec<Arc<CertStore>>,
}

impl ReloadService {
    /// Validates the file and swaps what can change without a restart.
    pub fn reload(&self) -> Result<(), String> {
        let cfg = Config::load(&self.path).map_err(|e| e.to_string())?;
        // Renewed certificates first: a file that fails to load refuses the whole reload.
        for certs in &self.tls_certs {
            certs.reload()?;
        }
        self.tenants
            .store(Arc::new(TenantDirectory::from_config(&cfg)));
        self.hub.set_rules(cfg.policy_rules());
        self.quotas.configure(&cfg);
        self.config.store(Arc::new(cfg));
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
