//! The durable decision ledger (PostgreSQL). Built only when `database_url` is configured;
//! without it Sluice keeps decisions in the in-memory ring.
//!
//! * [`row`]: the ledger's owned copy of a decision record (also the spool's line format).
//! * [`batch`]: a batch of rows as one `INSERT … SELECT * FROM unnest(…)` per table.
//! * [`migrate`]: the schema as embedded, versioned migrations (`migrations/*.sql`).
//! * [`db`]: every statement the ledger runs, on two `r2d2` pools (writes, fast-failing reads).
//! * [`spool`]: the append-only local spool rows wait in while PostgreSQL is down or slow.
//! * [`writer`]: the request-side sink, its bounded buffer and the writer service.
//! * [`sla`]: the SLA-violation rate computed from the ledger and fed to the policy.
//! * [`retention`]: batched deletion of rows older than `retention_days`.
//! * [`query`]: `/decisions/recent` from PostgreSQL.
//! * [`export`]: rows over a time range, for `sluice replay` and its JSONL export.
//!
//! Tables: `decisions` (one row per request, every [`sluice_record::decision::DecisionRecord`] field
//! as a column, signals flattened to `signal_*`, the replay inputs as `inputs` bytes in the
//! binary form of [`sluice_record::binary`]) and
//! `queue_events` (the queue lifecycle —
//! `queue_queued`, `queue_released`, `queue_timed_out`, `queue_dropped` — one row per event,
//! derived from the record's `queue_outcome` and `queue_wait_ms` and written in the same
//! transaction as its decision row). A separate table rather than extra columns because a
//! request has zero to two events and they are queried by time on their own.

pub mod batch;
pub mod db;
pub mod export;
pub mod migrate;
pub mod query;
pub mod retention;
pub mod row;
pub mod sla;
pub mod spool;
pub mod writer;

use pingora::services::background::background_service;
use pingora::services::ServiceWithDependents;
use sluice_config::Config;
use sluice_record::decision::{DecisionQuery, DecisionSink};
use sluice_runtime::signals::SignalHub;
use std::sync::Arc;
use std::time::Duration;

/// What the ledger adds to the server: record sinks, a query backend for `/decisions/recent`,
/// and the background services (writer, SLA-rate computation, retention) to register.
#[derive(Default)]
pub struct LedgerParts {
    pub sinks: Vec<Arc<dyn DecisionSink>>,
    pub query: Option<Arc<dyn DecisionQuery>>,
    pub services: Vec<Box<dyn ServiceWithDependents>>,
}

/// The spool's file-name prefix: names the schema and the database, so instances pointed at
/// different databases can share a spool directory without replaying into each other's.
pub fn spool_prefix(db: &db::Db) -> String {
    format!("ledger-{}-{}-", db.schema(), db.fingerprint())
}

/// Opens the spool and prepares the pools; connects to nothing, so the proxy starts (and
/// spools) while PostgreSQL is down. The writer migrates the schema on its first step.
pub fn open(cfg: &Config, url: &str) -> Result<Arc<writer::Ledger>, String> {
    let l = &cfg.ledger;
    let db = db::Db::with_commit(url, &l.schema, l.synchronous_commit)?;
    let spool = spool::Spool::open(&l.spool_dir, &spool_prefix(&db), l.spool_max_bytes)
        .map_err(|e| format!("ledger.spool_dir {}: {e}", l.spool_dir.display()))?;
    let foreign = spool.foreign_segments();
    if foreign > 0 {
        log::warn!(
            "{}",
            serde_json::json!({"event": "ledger_spool_foreign_segments", "files": foreign,
                   "spool_dir": l.spool_dir.display().to_string(),
                   "note": "spooled for another database_url or schema; replayed only by an instance configured for it"})
        );
    }
    if spool.rows() > 0 {
        log::warn!(
            "{}",
            serde_json::json!({"event": "ledger_spool_found", "rows": spool.rows(),
                   "spool_dir": l.spool_dir.display().to_string(), "note": "replayed once PostgreSQL is reachable"})
        );
    }
    let settings = writer::Settings {
        flush_interval: Duration::from_millis(l.flush_interval_ms),
        batch_rows: l.batch_rows,
        buffer_rows: l.buffer_rows,
    };
    Ok(writer::Ledger::new(
        settings,
        db,
        spool,
        l.sla_window_seconds,
        (l.sla_window_requests > 0).then_some(l.sla_window_requests),
    ))
}

pub fn build(cfg: &Config, hub: Arc<SignalHub>) -> Result<LedgerParts, String> {
    let Some(url) = cfg.database_url.as_deref() else {
        return Ok(LedgerParts::default());
    };
    let ledger = open(cfg, url)?;
    let sla = sla::SlaService {
        ledger: Arc::clone(&ledger),
        hub,
        every: sla::interval_for(cfg.signals.stale_after_ms),
        window: Duration::from_secs(cfg.ledger.sla_window_seconds),
        last_n: (cfg.ledger.sla_window_requests > 0).then_some(cfg.ledger.sla_window_requests),
    };
    let retention = retention::Retention {
        ledger: Arc::clone(&ledger),
        days: cfg.ledger.retention_days,
    };
    Ok(LedgerParts {
        sinks: vec![Arc::new(writer::LedgerSink(Arc::clone(&ledger)))],
        query: Some(Arc::new(query::LedgerQuery(Arc::clone(&ledger)))),
        services: vec![
            Box::new(background_service(
                "ledger writer",
                writer::Writer(Arc::clone(&ledger)),
            )),
            Box::new(background_service("ledger sla rate", sla)),
            Box::new(background_service("ledger retention", retention)),
        ],
    })
}
