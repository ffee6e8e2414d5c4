//! The ledger's write path: the request-side sink, the bounded buffer, and the writer service
//! that moves rows to PostgreSQL — or, when it cannot, to the spool.
//!
//! Rows only ever move forward through `[in flight] → [spool] → [buffer]` (oldest to newest),
//! which is what keeps them in order:
//!
//! * [`LedgerSink::record`] (Pingora's `logging` phase) pushes onto the buffer under a short
//!   mutex and returns; it never does I/O and never waits for the writer. A full buffer means the
//!   spool cannot keep up with the disk: the row is dropped and counted.
//! * A writer step replays the spool's front first (`INSERT … ON CONFLICT DO NOTHING`: those
//!   rows may be there already); only when the spool is empty does it take the next batch from
//!   the buffer, keeping it as the *in-flight* batch until it commits. Those rows were never
//!   written, so they go in with binary `COPY` (see [`super::batch`]), encoded on this thread
//!   into reused buffers; the request threads only ever push an `Arc` of the record.
//! * A spill appends the in-flight batch (unless already spooled) and then the whole buffer to
//!   the spool's end. It runs when PostgreSQL is down, when the buffer passes half full while a
//!   write is stuck, on shutdown, and at exit. A batch that is spooled *and* later commits is
//!   replayed once more and skipped by `ON CONFLICT`, so nothing is lost and nothing doubles.
//!
//! Lock order, everywhere: in-flight → spool → buffer. The sink takes only the buffer's lock.

use super::batch::CopyBatch;
use super::db::{Db, InsertError};
use super::row::{clean, LedgerRow};
use super::spool::Spool;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde::Serialize;
use serde_json::{json, Value};
use sluice_record::decision::{DecisionRecord, DecisionSink};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::{JoinError, JoinHandle};

/// The longest pause between reconnection attempts while PostgreSQL is down.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often the spool directory is scanned for segments a process left behind (a graceful
/// upgrade's old process spools its remainder after this one started).
const ADOPT_EVERY: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The write-path knobs of `ledger:` (see [`sluice_config::LedgerConfig`]).
#[derive(Debug, Clone)]
pub struct Settings {
    pub flush_interval: Duration,
    pub batch_rows: usize,
    pub buffer_rows: usize,
}

impl Settings {
    fn high_water(&self) -> usize {
        (self.buffer_rows / 2).max(1)
    }
}

/// What one writer step achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing to write.
    Idle,
    /// A batch committed; there may be more.
    Progress,
    /// PostgreSQL refused or could not be reached; memory was spilled to the spool.
    Failed,
}

struct Inflight {
    /// Shared with the records the request threads pushed: a clean record is not copied.
    rows: Arc<Vec<Arc<LedgerRow>>>,
    /// Already in the spool (a spill happened while it was being written).
    spooled: bool,
}

#[derive(Default)]
struct Stats {
    migrated: AtomicBool,
    /// The last attempt to reach PostgreSQL failed.
    down: AtomicBool,
    /// The writer's runtime is gone: records go straight to the spool.
    closed: AtomicBool,
    rows_written: AtomicU64,
    rows_duplicate: AtomicU64,
    /// Transactions that committed rows (rows_written / batches_written = the batch size).
    batches_written: AtomicU64,
    rows_spilled: AtomicU64,
    /// Rows PostgreSQL refused as data (see [`InsertError::Rejected`]), dropped and logged.
    rows_rejected: AtomicU64,
    flush_errors: AtomicU64,
    /// Milliseconds after `started` of the last commit, plus one (0 = never).
    last_flush: AtomicU64,
    spooled_rows: AtomicU64,
    spool_bytes: AtomicU64,
    dropped_buffer_full: AtomicU64,
    dropped_spool_full: AtomicU64,
    spool_corrupt: AtomicU64,
    reported_drops: AtomicU64,
    last_adopt: AtomicU64,
    /// Mirrors of the in-flight batch, so `/status` and the drain never wait on its lock
    /// (a spill holds it across an fsync).
    inflight_rows: AtomicU64,
    inflight_unspooled: AtomicU64,
}

/// The SLA window last computed, for `/status`.
#[derive(Debug, Clone)]
pub struct SlaReport {
    pub at: Instant,
    pub value: Result<super::db::SlaWindow, String>,
}

/// State shared by the sink, the writer, the SLA and retention services and the query.
pub struct Ledger {
    settings: Settings,
    db: Db,
    spool_dir: String,
    buffer: Mutex<VecDeque<Arc<DecisionRecord>>>,
    inflight: Mutex<Option<Inflight>>,
    spool: Mutex<Spool>,
    /// The writer's COPY buffers, reused from batch to batch (only the writer step takes it).
    copy: Mutex<CopyBatch>,
    wake: Notify,
    started: Instant,
    stats: Stats,
    last_error: Mutex<Option<String>>,
    sla: Mutex<Option<SlaReport>>,
    sla_window_seconds: u64,
    sla_window_requests: Option<u64>,
}

impl Ledger {
    pub fn new(
        settings: Settings,
        db: Db,
        spool: Spool,
        sla_window_seconds: u64,
        sla_window_requests: Option<u64>,
    ) -> Arc<Ledger> {
        let ledger = Ledger {
            settings,
            db,
            spool_dir: spool.dir().display().to_string(),
            buffer: Mutex::new(VecDeque::new()),
            inflight: Mutex::new(None),
            spool: Mutex::new(spool),
            copy: Mutex::new(CopyBatch::default()),
            wake: Notify::new(),
            started: Instant::now(),
            stats: Stats::default(),
            last_error: Mutex::new(None),
            sla: Mutex::new(None),
            sla_window_seconds,
            sla_window_requests,
        };
        ledger.note_spool(&lock(&ledger.spool));
        Arc::new(ledger)
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// Migrated and the last attempt succeeded: reads are worth trying.
    pub fn reachable(&self) -> bool {
        self.stats.migrated.load(Ordering::Relaxed) && !self.stats.down.load(Ordering::Relaxed)
    }

    pub fn last_error(&self) -> String {
        lock(&self.last_error)
            .clone()
            .unwrap_or_else(|| "not connected yet".into())
    }

    pub fn set_sla(&self, report: SlaReport) {
        *lock(&self.sla) = Some(report);
    }

    /// Queues a record for writing. Never blocks on I/O while the writer runs.
    pub fn push(&self, record: Arc<DecisionRecord>) {
        let len = {
            let mut buf = lock(&self.buffer);
            if buf.len() >= self.settings.buffer_rows {
                drop(buf);
                self.stats
                    .dropped_buffer_full
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
            buf.push_back(record);
            buf.len()
        };
        if self.stats.closed.load(Ordering::Acquire) {
            // Nothing will write the buffer any more (the process is exiting): persist now.
            self.spill();
            return;
        }
        if len % self.settings.batch_rows.max(1) == 0 || len == self.settings.high_water() {
            self.wake.notify_one();
        }
    }

    pub fn buffered(&self) -> usize {
        lock(&self.buffer).len()
    }

    /// Rows that exist only in memory (would be lost by an exit right now).
    pub fn memory_rows(&self) -> usize {
        self.stats.inflight_unspooled.load(Ordering::Relaxed) as usize + self.buffered()
    }

    fn set_inflight(&self, slot: &mut Option<Inflight>, value: Option<Inflight>) {
        let (rows, unspooled) = value.as_ref().map_or((0, 0), |f| {
            let n = f.rows.len() as u64;
            (n, if f.spooled { 0 } else { n })
        });
        *slot = value;
        self.stats.inflight_rows.store(rows, Ordering::Relaxed);
        self.stats
            .inflight_unspooled
            .store(unspooled, Ordering::Relaxed);
    }

    /// Something to do now; buffered rows count only as a full batch unless a flush is due.
    fn has_work(&self, flush_due: bool) -> bool {
        let buffered = self.buffered();
        !self.stats.migrated.load(Ordering::Relaxed)
            || buffered >= self.settings.batch_rows.max(1)
            || flush_due && buffered > 0
            || self.stats.spooled_rows.load(Ordering::Relaxed) > 0
            || self.adopt_due()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn adopt_due(&self) -> bool {
        self.now_ms()
            .saturating_sub(self.stats.last_adopt.load(Ordering::Relaxed))
            >= ADOPT_EVERY.as_millis() as u64
    }

    fn note_spool(&self, spool: &Spool) {
        self.stats
            .spooled_rows
            .store(spool.rows(), Ordering::Relaxed);
        self.stats
            .spool_bytes
            .store(spool.bytes(), Ordering::Relaxed);
    }

    fn failed(&self, e: String) {
        self.stats.flush_errors.fetch_add(1, Ordering::Relaxed);
        let was_down = self.stats.down.swap(true, Ordering::Relaxed);
        if !was_down {
            log::warn!(
                "{}",
                json!({"event": "ledger_unreachable", "error": e, "schema": self.db.schema(),
                       "buffered_rows": self.buffered(), "note": "rows spill to the spool until PostgreSQL is back"})
            );
        }
        *lock(&self.last_error) = Some(e);
    }

    fn committed(&self, batch: usize, new_rows: u64) {
        self.stats
            .rows_written
            .fetch_add(new_rows, Ordering::Relaxed);
        self.stats
            .rows_duplicate
            .fetch_add((batch as u64).saturating_sub(new_rows), Ordering::Relaxed);
        self.stats.batches_written.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_flush
            .store(self.now_ms() + 1, Ordering::Relaxed);
        if self.stats.down.swap(false, Ordering::Relaxed) {
            log::warn!(
                "{}",
                json!({"event": "ledger_reconnected", "schema": self.db.schema(),
                       "spooled_rows": self.stats.spooled_rows.load(Ordering::Relaxed)})
            );
        }
    }

    /// Writes fresh rows (taken from the buffer, never written before) with binary `COPY`.
    /// When PostgreSQL refuses the `COPY` — a row already there (a client reused its
    /// `x-request-id` within the same millisecond) or a row it cannot take — the batch goes the
    /// replay's way instead ([`Ledger::write`]), which skips duplicates and isolates a bad row.
    fn write_fresh(&self, rows: &[Arc<LedgerRow>]) -> Result<u64, String> {
        let copied = {
            let mut copy = lock(&self.copy);
            copy.encode(rows);
            self.db.copy(&copy)
        };
        match copied {
            Ok(n) => Ok(n),
            Err(InsertError::Unavailable(e)) => Err(e),
            Err(InsertError::Rejected(_)) => self.write(rows),
        }
    }

    /// Writes a batch; when PostgreSQL refuses its data, writes the rows one by one so a single
    /// bad row is dropped (counted and logged) instead of blocking every row behind it forever.
    /// `Err` only when PostgreSQL is unavailable.
    fn write<R: std::borrow::Borrow<LedgerRow>>(&self, rows: &[R]) -> Result<u64, String> {
        match self.db.insert(rows) {
            Ok(n) => Ok(n),
            Err(InsertError::Unavailable(e)) => Err(e),
            Err(InsertError::Rejected(e)) if rows.len() == 1 => {
                self.rejected(rows[0].borrow(), &e);
                Ok(0)
            }
            Err(InsertError::Rejected(_)) => {
                let mut written = 0;
                for row in rows {
                    let row = row.borrow();
                    match self.db.insert(std::slice::from_ref(row)) {
                        Ok(n) => written += n,
                        Err(InsertError::Rejected(e)) => self.rejected(row, &e),
                        Err(InsertError::Unavailable(e)) => return Err(e),
                    }
                }
                Ok(written)
            }
        }
    }

    fn rejected(&self, row: &LedgerRow, error: &str) {
        self.stats.rows_rejected.fetch_add(1, Ordering::Relaxed);
        log::error!(
            "{}",
            json!({"event": "ledger_row_rejected", "request_id": row.request_id, "error": error,
                   "row": row})
        );
    }

    /// Moves every row that exists only in memory to the end of the spool, in order.
    pub fn spill(&self) {
        let mut inflight = lock(&self.inflight);
        self.spill_locked(&mut inflight);
    }

    fn spill_locked(&self, inflight: &mut Option<Inflight>) {
        let mut spool = lock(&self.spool);
        let mut rows: Vec<Arc<LedgerRow>> = Vec::new();
        if let Some(f) = inflight.as_mut().filter(|f| !f.spooled) {
            rows.extend(f.rows.iter().cloned());
            f.spooled = true;
            self.stats.inflight_unspooled.store(0, Ordering::Relaxed);
        }
        let records: Vec<_> = lock(&self.buffer).drain(..).collect();
        rows.extend(records.into_iter().map(clean));
        if rows.is_empty() {
            return;
        }
        match spool.append(&rows) {
            Ok(a) => {
                self.stats
                    .rows_spilled
                    .fetch_add(a.written, Ordering::Relaxed);
                self.stats
                    .dropped_spool_full
                    .fetch_add(a.dropped, Ordering::Relaxed);
            }
            Err(e) => {
                self.stats
                    .dropped_spool_full
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                log::error!(
                    "{}",
                    json!({"event": "ledger_spool_write_failed", "error": e.to_string(),
                           "spool_dir": self.spool_dir, "rows": rows.len()})
                );
            }
        }
        self.note_spool(&spool);
    }

    /// One batch: the spool's front if it has rows, else the buffer's. Blocking.
    pub fn step(&self) -> Step {
        self.step_with(&mut true)
    }

    /// [`Ledger::step`]; from the buffer only a full batch unless `partial`, which a partial
    /// batch uses up.
    fn step_with(&self, partial: &mut bool) -> Step {
        if !self.stats.migrated.load(Ordering::Relaxed) {
            match self.db.migrate() {
                Ok(applied) => {
                    self.stats.migrated.store(true, Ordering::Relaxed);
                    if !applied.is_empty() {
                        log::info!(
                            "{}",
                            json!({"event": "ledger_migrated", "schema": self.db.schema(), "applied": applied})
                        );
                    }
                }
                Err(e) => {
                    self.failed(format!("migrating: {e}"));
                    self.spill();
                    return Step::Failed;
                }
            }
        }
        if self.adopt_due() {
            self.stats
                .last_adopt
                .store(self.now_ms(), Ordering::Relaxed);
            let mut spool = lock(&self.spool);
            match spool.adopt_orphans() {
                Ok(0) => {}
                Ok(n) => log::warn!(
                    "{}",
                    json!({"event": "ledger_spool_adopted", "rows": n, "spool_dir": self.spool_dir})
                ),
                Err(e) => log::warn!(
                    "{}",
                    json!({"event": "ledger_spool_scan_failed", "error": e.to_string(), "spool_dir": self.spool_dir})
                ),
            }
            self.note_spool(&spool);
        }

        let peek = {
            let mut spool = lock(&self.spool);
            if spool.is_empty() {
                None
            } else {
                match spool.peek(self.settings.batch_rows) {
                    Ok(p) => p,
                    Err(e) => {
                        log::error!(
                            "{}",
                            json!({"event": "ledger_spool_read_failed", "error": e.to_string(), "spool_dir": self.spool_dir})
                        );
                        return Step::Failed;
                    }
                }
            }
        };
        if let Some(p) = peek {
            if p.corrupt > 0 {
                self.stats
                    .spool_corrupt
                    .fetch_add(p.corrupt, Ordering::Relaxed);
                log::warn!(
                    "{}",
                    json!({"event": "ledger_spool_corrupt_lines", "lines": p.corrupt, "spool_dir": self.spool_dir})
                );
            }
            return match self.write(&p.rows) {
                Ok(n) => {
                    let mut spool = lock(&self.spool);
                    spool.commit(&p);
                    self.note_spool(&spool);
                    drop(spool);
                    self.committed(p.rows.len(), n);
                    Step::Progress
                }
                Err(e) => {
                    self.failed(e);
                    self.spill();
                    Step::Failed
                }
            };
        }

        let rows = {
            // Holding the in-flight lock keeps spills out while the batch is taken: a spill
            // either ran before (its rows are in the spool and go first) or will see this batch.
            let mut inflight = lock(&self.inflight);
            if !lock(&self.spool).is_empty() {
                return Step::Progress;
            }
            let records: Vec<_> = {
                let mut buf = lock(&self.buffer);
                let batch = self.settings.batch_rows.max(1);
                if buf.len() < batch && !*partial {
                    return Step::Idle;
                }
                let n = buf.len().min(batch);
                if n < batch {
                    *partial = false;
                }
                buf.drain(..n).collect()
            };
            if records.is_empty() {
                return Step::Idle;
            }
            let rows: Arc<Vec<Arc<LedgerRow>>> = Arc::new(records.into_iter().map(clean).collect());
            self.set_inflight(
                &mut inflight,
                Some(Inflight {
                    rows: Arc::clone(&rows),
                    spooled: false,
                }),
            );
            rows
        };
        match self.write_fresh(&rows) {
            Ok(n) => {
                self.set_inflight(&mut lock(&self.inflight), None);
                self.committed(rows.len(), n);
                Step::Progress
            }
            Err(e) => {
                self.failed(e);
                let mut inflight = lock(&self.inflight);
                self.spill_locked(&mut inflight);
                self.set_inflight(&mut inflight, None);
                Step::Failed
            }
        }
    }

    /// Steps until there is nothing left or PostgreSQL fails. Blocking.
    pub fn drain(&self) -> Step {
        self.drain_with(true)
    }

    /// Steps while there is a full batch (or the spool) to write; with `flush`, also writes one
    /// partial batch — what the flush interval is for. Rows that arrive while a batch is being
    /// written wait for a full batch or the next flush instead of going out a few at a time:
    /// per batch, PostgreSQL pays a statement, a commit and a WAL flush.
    fn drain_with(&self, flush: bool) -> Step {
        let mut partial = flush;
        let mut last = Step::Idle;
        loop {
            match self.step_with(&mut partial) {
                Step::Progress => last = Step::Progress,
                Step::Idle => return last,
                Step::Failed => return Step::Failed,
            }
        }
    }

    /// Logs drops since the last report: they are counted in `/status` and never silent.
    fn report_drops(&self) {
        let buffer_full = self.stats.dropped_buffer_full.load(Ordering::Relaxed);
        let spool_full = self.stats.dropped_spool_full.load(Ordering::Relaxed);
        let total = buffer_full + spool_full;
        let before = self.stats.reported_drops.swap(total, Ordering::Relaxed);
        if total > before {
            log::error!(
                "{}",
                json!({"event": "ledger_rows_dropped", "dropped": total - before, "dropped_total": total,
                       "buffer_full": buffer_full, "spool_full": spool_full,
                       "spool_dir": self.spool_dir, "spool_bytes": self.stats.spool_bytes.load(Ordering::Relaxed)})
            );
        }
    }

    pub fn status(&self) -> LedgerStatus {
        let s = &self.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let last = load(&s.last_flush);
        let now = self.now_ms();
        let sla = lock(&self.sla).clone().map(|r| {
            let (window, error) = match r.value {
                Ok(w) => (Some(SlaStatus::from(&w)), None),
                Err(e) => (None, Some(e)),
            };
            SlaView {
                rate: window.as_ref().map(|w| w.rate),
                window,
                error,
                computed_ms_ago: r.at.elapsed().as_millis() as u64,
            }
        });
        LedgerStatus {
            sink: "postgres",
            schema: self.db.schema().to_string(),
            reachable: self.reachable(),
            migrated: s.migrated.load(Ordering::Relaxed),
            buffered_rows: self.buffered(),
            inflight_rows: load(&s.inflight_rows),
            spooled_rows: load(&s.spooled_rows),
            spool_bytes: load(&s.spool_bytes),
            spool_dir: self.spool_dir.clone(),
            last_flush_ms_ago: (last > 0).then(|| now.saturating_sub(last - 1)),
            rows_written: load(&s.rows_written),
            rows_duplicate: load(&s.rows_duplicate),
            batches_written: load(&s.batches_written),
            rows_spilled: load(&s.rows_spilled),
            rows_rejected: load(&s.rows_rejected),
            flush_errors: load(&s.flush_errors),
            dropped: load(&s.dropped_buffer_full) + load(&s.dropped_spool_full),
            dropped_buffer_full: load(&s.dropped_buffer_full),
            dropped_spool_full: load(&s.dropped_spool_full),
            spool_corrupt_lines: load(&s.spool_corrupt),
            last_error: lock(&self.last_error).clone(),
            sla_window_seconds: self.sla_window_seconds,
            sla_window_requests: self.sla_window_requests,
            sla,
        }
    }
}

/// The ledger in `/status`: where rows are (buffered, in flight, spooled), what was written,
/// rejected or dropped, and the SLA-violation window it computes.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerStatus {
    pub sink: &'static str,
    pub schema: String,
    pub reachable: bool,
    pub migrated: bool,
    pub buffered_rows: usize,
    pub inflight_rows: u64,
    pub spooled_rows: u64,
    pub spool_bytes: u64,
    pub spool_dir: String,
    pub last_flush_ms_ago: Option<u64>,
    pub rows_written: u64,
    pub rows_duplicate: u64,
    pub batches_written: u64,
    pub rows_spilled: u64,
    pub rows_rejected: u64,
    pub flush_errors: u64,
    pub dropped: u64,
    pub dropped_buffer_full: u64,
    pub dropped_spool_full: u64,
    pub spool_corrupt_lines: u64,
    pub last_error: Option<String>,
    pub sla_window_seconds: u64,
    pub sla_window_requests: Option<u64>,
    pub sla: Option<SlaView>,
}

/// The SLA-violation window's last computation: the figures, or why there are none.
#[derive(Debug, Clone, Serialize)]
pub struct SlaView {
    /// Null when the last computation failed.
    pub rate: Option<f64>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub window: Option<SlaStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub computed_ms_ago: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SlaStatus {
    #[serde(skip)]
    pub rate: f64,
    pub completed: u64,
    pub violated: u64,
    pub per_tier: std::collections::BTreeMap<String, TierSla>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TierSla {
    pub completed: u64,
    pub violated: u64,
    pub rate: f64,
}

impl From<&super::db::SlaWindow> for SlaStatus {
    fn from(w: &super::db::SlaWindow) -> Self {
        SlaStatus {
            rate: w.rate(),
            completed: w.completed,
            violated: w.violated,
            per_tier: w
                .per_tier
                .iter()
                .map(|(t, &(completed, violated))| {
                    let rate = if completed == 0 {
                        0.0
                    } else {
                        violated as f64 / completed as f64
                    };
                    let sla = TierSla {
                        completed,
                        violated,
                        rate,
                    };
                    (t.clone(), sla)
                })
                .collect(),
        }
    }
}

/// The [`DecisionSink`] the proxy calls.
pub struct LedgerSink(pub Arc<Ledger>);

#[async_trait]
impl DecisionSink for LedgerSink {
    fn record(&self, record: Arc<DecisionRecord>) {
        self.0.push(record);
    }

    fn status(&self) -> Value {
        serde_json::to_value(self.0.status()).unwrap_or(Value::Null)
    }

    fn healthy(&self) -> Option<bool> {
        Some(self.0.reachable())
    }

    /// The drain's last call: wait for the writer while PostgreSQL takes the rows, and spool
    /// whatever is still only in memory when it cannot or time runs out.
    async fn flush(&self, timeout: Duration) {
        let started = Instant::now();
        let margin = (timeout / 4).min(Duration::from_millis(500));
        self.0.wake.notify_one();
        loop {
            if self.0.memory_rows() == 0 {
                break;
            }
            let down = self.0.stats.down.load(Ordering::Relaxed);
            if down || started.elapsed() + margin >= timeout {
                let ledger = Arc::clone(&self.0);
                if tokio::task::spawn_blocking(move || ledger.spill())
                    .await
                    .is_err()
                {
                    self.0.spill();
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.0.report_drops();
        log::info!(
            "{}",
            json!({"event": "ledger_flushed", "seconds": started.elapsed().as_secs_f64(),
                   "spooled_rows": self.0.stats.spooled_rows.load(Ordering::Relaxed),
                   "rows_written": self.0.stats.rows_written.load(Ordering::Relaxed)})
        );
    }
}

/// Spools what is left in memory when the writer's runtime drops its task (process exit), and
/// from then on has records spooled directly.
struct ExitGuard(Arc<Ledger>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.0.stats.closed.store(true, Ordering::Release);
        self.0.spill();
        self.0.report_drops();
    }
}

async fn finished<T>(job: &mut Option<JoinHandle<T>>) -> Result<T, JoinError> {
    match job.as_mut() {
        Some(j) => j.await,
        None => std::future::pending().await,
    }
}

/// The background service that writes: what is buffered every `flush_interval_ms`, and a full
/// batch as soon as `batch_rows` are buffered. Each write runs on a blocking thread; this loop
/// stays free to spill the buffer while a write is stuck.
pub struct Writer(pub Arc<Ledger>);

#[async_trait]
impl BackgroundService for Writer {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let ledger = Arc::clone(&self.0);
        let _exit = ExitGuard(Arc::clone(&ledger));
        let interval = ledger.settings.flush_interval;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut job: Option<JoinHandle<Step>> = None;
        let mut spill_job: Option<JoinHandle<()>> = None;
        let mut retry_at = tokio::time::Instant::now();
        let mut backoff = interval;
        let mut watching = true;
        // A tick passed since the last drain started: write the partial batch too.
        let mut flush_due = false;
        loop {
            tokio::select! {
                _ = tick.tick() => flush_due = true,
                _ = ledger.wake.notified() => {}
                changed = shutdown.changed(), if watching => {
                    // Requests still finish during the grace period: keep writing, but make sure
                    // nothing sits only in memory if PostgreSQL is not there to take it.
                    if changed.is_err() || *shutdown.borrow() {
                        watching = false;
                        log::info!(
                            "{}",
                            json!({"event": "ledger_shutdown_signalled", "buffered_rows": ledger.buffered(),
                                   "reachable": ledger.reachable()})
                        );
                    }
                }
                done = finished(&mut job) => {
                    job = None;
                    match done {
                        Ok(Step::Failed) | Err(_) => {
                            retry_at = tokio::time::Instant::now() + backoff;
                            backoff = (backoff * 2).min(MAX_BACKOFF.max(interval));
                        }
                        Ok(_) => backoff = interval,
                    }
                    if let Err(e) = done {
                        log::error!("{}", json!({"event": "ledger_writer_step_failed", "error": e.to_string()}));
                    }
                }
            }
            if spill_job.as_ref().is_some_and(|j| j.is_finished()) {
                spill_job = None;
            }
            let buffered = ledger.buffered();
            let down =
                ledger.stats.down.load(Ordering::Relaxed) || !watching && !ledger.reachable();
            let stuck = job.is_some() && buffered >= ledger.settings.high_water();
            if spill_job.is_none() && buffered > 0 && (down || stuck) {
                let l = Arc::clone(&ledger);
                spill_job = Some(tokio::task::spawn_blocking(move || l.spill()));
            }
            // Shutting down: nothing waits for a full batch.
            let flush = flush_due || !watching;
            if job.is_none() && tokio::time::Instant::now() >= retry_at && ledger.has_work(flush) {
                flush_due = false;
                let l = Arc::clone(&ledger);
                job = Some(tokio::task::spawn_blocking(move || l.drain_with(flush)));
            }
            ledger.report_drops();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(name: &str, buffer_rows: usize) -> (Arc<Ledger>, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("sluice-writer-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Nothing listens on port 1: every connection attempt is refused.
        let db = Db::new("postgres://postgres@127.0.0.1:1/none", "sluice_unit").unwrap();
        let spool = Spool::open(&dir, "ledger-unit-", 1 << 20).unwrap();
        let settings = Settings {
            flush_interval: Duration::from_millis(50),
            batch_rows: 2,
            buffer_rows,
        };
        (Ledger::new(settings, db, spool, 60, None), dir)
    }

    fn rec(i: usize) -> Arc<DecisionRecord> {
        Arc::new(DecisionRecord {
            request_id: format!("r{i}"),
            received_at_ms: i as u64,
            ..Default::default()
        })
    }

    fn spooled_ids(l: &Ledger) -> Vec<String> {
        let mut spool = lock(&l.spool);
        let mut out = Vec::new();
        while let Some(p) = spool.peek(100).unwrap() {
            out.extend(p.rows.iter().map(|r| r.request_id.clone()));
            spool.commit(&p);
        }
        out
    }

    #[test]
    fn an_unreachable_database_spills_everything_in_order_and_counts_drops() {
        let (l, dir) = ledger("down", 4);
        for i in 0..3 {
            l.push(rec(i));
        }
        assert_eq!(l.step(), Step::Failed);
        assert!(!l.reachable());
        assert_eq!(l.memory_rows(), 0, "nothing left only in memory");
        assert_eq!(l.status().spooled_rows, 3);
        for i in 3..9 {
            l.push(rec(i));
        }
        assert_eq!(
            l.status().dropped_buffer_full,
            2,
            "a full buffer drops, counted"
        );
        l.spill();
        assert_eq!(spooled_ids(&l), ["r0", "r1", "r2", "r3", "r4", "r5", "r6"]);
        let s = l.status();
        assert_eq!(s.dropped, 2);
        assert!(s.last_error.unwrap().contains("migrating"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_inflight_batch_is_spooled_ahead_of_the_buffer() {
        let (l, dir) = ledger("inflight", 100);
        l.set_inflight(
            &mut lock(&l.inflight),
            Some(Inflight {
                rows: Arc::new(vec![clean(rec(0))]),
                spooled: false,
            }),
        );
        assert_eq!(l.memory_rows(), 1);
        l.push(rec(1));
        l.spill();
        assert_eq!(l.memory_rows(), 0);
        // Spilling again must not write the in-flight batch twice.
        l.push(rec(2));
        l.spill();
        assert_eq!(spooled_ids(&l), ["r0", "r1", "r2"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
