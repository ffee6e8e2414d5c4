//! Export off the request path: finished spans go into a bounded queue with `try_send` (full:
//! dropped and counted, never waited for), and one background task sends them to the collector
//! in batches, `POST {traces_url}` with `content-type: application/x-protobuf`.
//!
//! A batch leaves when `batch_spans` spans are queued or `flush_ms` has passed, whichever comes
//! first. Each request is bounded by `timeout_ms`; a batch that fails (refused, HTTP error,
//! timeout, unreachable) is dropped and counted, never retried, and after consecutive failures
//! the next attempt waits longer (doubling from `flush_ms` up to [`MAX_BACKOFF`]), so a
//! collector that is down, slow or refusing costs requests nothing: only the queue fills and
//! then spans are dropped at the door. At shutdown what is queued gets one last attempt.
//!
//! Plain HTTP only (hyper's client, as the Prometheus poller uses); https is refused by
//! validation.

use crate::config::{check_url, TracingConfig, TracingConfigError};
use crate::otlp::{encode_request, encode_resource, Scope};
use crate::span::Span;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, USER_AGENT};
use http::{HeaderMap, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

/// The longest wait between attempts while the collector keeps failing.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A collector's answer is a few bytes; more is not read.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// How much of an error body is quoted in `last_error`.
const QUOTE_BYTES: usize = 200;

/// The exporter's counters, for metrics and `/status`. Monotonic except `queued` (read from the
/// queue) and the last error.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Spans the collector accepted (a 2xx answer).
    pub spans_exported: AtomicU64,
    /// Spans dropped at submission because the queue was full (or the exporter gone).
    pub spans_dropped: AtomicU64,
    /// Spans lost with a failed batch.
    pub spans_failed: AtomicU64,
    pub batches_exported: AtomicU64,
    pub batches_failed: AtomicU64,
    /// Failures in a row now; 0 once a batch succeeds.
    pub consecutive_failures: AtomicU64,
    /// Unix milliseconds of the last failure, 0 if none.
    pub last_error_at_ms: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl ExportStats {
    /// Why the last failed batch failed (kept after a later success).
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn failed(&self, spans: usize, why: String) {
        self.batches_failed.fetch_add(1, Relaxed);
        self.spans_failed.fetch_add(spans as u64, Relaxed);
        self.consecutive_failures.fetch_add(1, Relaxed);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.last_error_at_ms.store(now, Relaxed);
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }
}

/// What the exporter needs, resolved from [`TracingConfig`].
#[derive(Debug, Clone)]
pub struct ExportSettings {
    pub url: Uri,
    pub headers: HeaderMap,
    pub resource: Vec<(String, String)>,
    pub queue_spans: usize,
    pub batch_spans: usize,
    pub flush: Duration,
    pub timeout: Duration,
}

impl ExportSettings {
    pub fn from_config(cfg: &TracingConfig) -> Result<Self, TracingConfigError> {
        cfg.validate()?;
        let url_err = |reason| TracingConfigError {
            variable: None,
            key: "telemetry.tracing.endpoint",
            reason,
        };
        let url = check_url(&cfg.traces_url()).map_err(url_err)?;
        let mut headers = HeaderMap::new();
        for (k, v) in &cfg.headers {
            // validate() checked both.
            if let (Ok(k), Ok(v)) = (
                HeaderName::from_bytes(k.as_bytes()),
                HeaderValue::from_str(v),
            ) {
                headers.insert(k, v);
            }
        }
        Ok(Self {
            url,
            headers,
            resource: cfg.resource(),
            queue_spans: cfg.queue_spans,
            batch_spans: cfg.batch_spans,
            flush: Duration::from_millis(cfg.flush_ms),
            timeout: Duration::from_millis(cfg.timeout_ms),
        })
    }
}

/// The request path's end of the queue: cheap to clone, never waits.
#[derive(Debug, Clone)]
pub struct SpanSink {
    tx: mpsc::Sender<Box<Span>>,
    wake: Arc<Notify>,
    batch: usize,
    stats: Arc<ExportStats>,
}

impl SpanSink {
    /// Queues a finished span; false (and counted in `spans_dropped`) when the queue is full or
    /// the exporter is gone. Wakes the exporter only when a full batch is waiting.
    pub fn submit(&self, span: Box<Span>) -> bool {
        match self.tx.try_send(span) {
            Ok(()) => {
                if self.queued() >= self.batch {
                    self.wake.notify_one();
                }
                true
            }
            Err(_) => {
                self.stats.spans_dropped.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Spans waiting now.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The background task's state; run it with [`Exporter::run`].
pub struct Exporter {
    rx: mpsc::Receiver<Box<Span>>,
    wake: Arc<Notify>,
    stats: Arc<ExportStats>,
    settings: ExportSettings,
    resource: Vec<u8>,
    client: HttpClient,
    /// Boxed as they came through the queue: unboxing would copy each span once more.
    #[allow(clippy::vec_box)]
    batch: Vec<Box<Span>>,
    buf: Vec<u8>,
}

/// The queue and its exporter.
pub fn channel(settings: ExportSettings) -> (SpanSink, Exporter) {
    let (tx, rx) = mpsc::channel(settings.queue_spans);
    let wake = Arc::new(Notify::new());
    let stats = Arc::new(ExportStats::default());
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(settings.timeout));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        .build(connector);
    let sink = SpanSink {
        tx,
        wake: wake.clone(),
        batch: settings.batch_spans,
        stats: stats.clone(),
    };
    let exporter = Exporter {
        rx,
        wake,
        stats,
        resource: encode_resource(&settings.resource),
        batch: Vec::with_capacity(settings.batch_spans),
        buf: Vec::new(),
        client,
        settings,
    };
    (sink, exporter)
}

impl Exporter {
    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    /// Sends batches until `shutdown` turns true (or its sender is dropped), then makes one
    /// last attempt with what is queued. Run it on its own task (a Pingora background service:
    /// `ShutdownWatch` is this `watch::Receiver<bool>`).
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let flush = self.settings.flush;
        let mut next_flush = Instant::now() + flush;
        while !*shutdown.borrow() {
            // While the collector fails, only the backoff timer ends the wait.
            let backing_off = self.stats.consecutive_failures.load(Relaxed) > 0;
            tokio::select! {
                _ = self.wake.notified(), if !backing_off => {}
                _ = tokio::time::sleep_until(next_flush) => {}
                r = shutdown.changed() => {
                    if r.is_err() {
                        break;
                    }
                    continue;
                }
            }
            let due = Instant::now() >= next_flush;
            // Every full batch now; a partial one only when the flush time has come (until
            // then its spans wait in `batch`).
            loop {
                let n = self.fill();
                if n == 0 || (n < self.settings.batch_spans && !due) {
                    break;
                }
                if !self.export().await || n < self.settings.batch_spans {
                    break;
                }
            }
            let failing = self.stats.consecutive_failures.load(Relaxed);
            if failing > 0 {
                next_flush = Instant::now() + backoff(flush, failing);
            } else if due {
                next_flush = Instant::now() + flush;
            }
        }
        self.fill_all();
        while !self.batch.is_empty() {
            let cut = self.batch.len().min(self.settings.batch_spans);
            let rest = self.batch.split_off(cut);
            if !self.export().await {
                self.stats
                    .spans_failed
                    .fetch_add(rest.len() as u64, Relaxed);
                break;
            }
            self.batch = rest;
        }
    }

    /// Moves queued spans into the batch, up to a batch; returns the batch's size.
    fn fill(&mut self) -> usize {
        while self.batch.len() < self.settings.batch_spans {
            match self.rx.try_recv() {
                Ok(s) => self.batch.push(s),
                Err(_) => break,
            }
        }
        self.batch.len()
    }

    /// Drops every queued span unsent; how many (measurements that run no exporter).
    pub fn discard_queued(&mut self) -> usize {
        let mut n = 0;
        while self.rx.try_recv().is_ok() {
            n += 1;
        }
        n
    }

    fn fill_all(&mut self) {
        while let Ok(s) = self.rx.try_recv() {
            self.batch.push(s);
        }
    }

    /// Sends the batch (emptied either way); true when the collector accepted it.
    async fn export(&mut self) -> bool {
        let n = self.batch.len();
        let scope = Scope {
            name: "sluice",
            version: env!("CARGO_PKG_VERSION"),
        };
        let start = encode_request(
            &mut self.buf,
            &self.resource,
            &scope,
            self.batch.iter().map(|s| &**s),
        );
        self.batch.clear();
        let len = self.buf.len();
        let body =
            Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(len))).slice(start..);
        let result = tokio::time::timeout(self.settings.timeout, self.post(body)).await;
        let outcome = match result {
            Ok(r) => r,
            Err(_) => Err(format!(
                "timed out after {} ms",
                self.settings.timeout.as_millis()
            )),
        };
        match outcome {
            Ok(()) => {
                let was_failing = self.stats.consecutive_failures.swap(0, Relaxed);
                self.stats.spans_exported.fetch_add(n as u64, Relaxed);
                self.stats.batches_exported.fetch_add(1, Relaxed);
                if was_failing > 0 {
                    log::info!(
                        "{}",
                        json!({"event": "trace_export_recovered", "url": self.settings.url.to_string(), "failed_batches": was_failing})
                    );
                }
                true
            }
            Err(why) => {
                if self.stats.consecutive_failures.load(Relaxed) == 0 {
                    log::warn!(
                        "{}",
                        json!({"event": "trace_export_failed", "url": self.settings.url.to_string(), "error": why, "message": "spans are dropped while the collector fails; requests are unaffected"})
                    );
                }
                self.stats.failed(n, why);
                false
            }
        }
    }

    async fn post(&self, body: Bytes) -> Result<(), String> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.settings.url.clone())
            .body(Full::new(body))
            .map_err(|e| format!("building the request: {e}"))?;
        let h = req.headers_mut();
        h.extend(self.settings.headers.clone());
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-protobuf"),
        );
        h.insert(
            USER_AGENT,
            HeaderValue::from_static(concat!("sluice/", env!("CARGO_PKG_VERSION"))),
        );
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| format!("unreachable: {}", chain(&e)))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        if status.is_success() {
            Ok(())
        } else {
            let text = String::from_utf8_lossy(&body[..body.len().min(QUOTE_BYTES)]);
            Err(format!("HTTP {}: {}", status.as_u16(), text.trim()))
        }
    }
}

/// The wait after `failures` failures in a row: `flush` doubled per failure, capped.
pub fn backoff(flush: Duration, failures: u64) -> Duration {
    let doublings = failures.saturating_sub(1).min(16) as u32;
    flush
        .saturating_mul(1 << doublings)
        .min(MAX_BACKOFF)
        .max(flush)
}

/// An error and its sources, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_flush_interval_and_is_capped() {
        let f = Duration::from_millis(100);
        assert_eq!(backoff(f, 1), f);
        assert_eq!(backoff(f, 2), Duration::from_millis(200));
        assert_eq!(backoff(f, 4), Duration::from_millis(800));
        assert_eq!(backoff(f, 60), MAX_BACKOFF);
        assert_eq!(backoff(Duration::from_secs(60), 3), Duration::from_secs(60));
    }
}
