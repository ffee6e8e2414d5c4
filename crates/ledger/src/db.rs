//! Everything the ledger says to PostgreSQL, all of it synchronous (`postgres` over `r2d2`):
//! callers run it on a blocking thread, never on a tokio worker.
//!
//! Two pools, so a slow write never delays a read and the reads can fail fast: the writer's
//! (and retention's) connections allow long statements, the read pool's (`/decisions/recent`,
//! the SLA window) give up after [`READ_STATEMENT_TIMEOUT_MS`] so `/decisions/recent` falls back
//! to the ring and the policy sees the signal as unavailable instead of waiting. A sync
//! `postgres::Client` carries its own small runtime, so one pool can be shared by services that
//! run on different Pingora runtimes.

use super::batch::{
    add_sla_seconds_sql, copy_decisions_sql, decision_column_list, insert_decisions_sql, Batch,
    CopyBatch, StoredInputs, COPY_QUEUE_EVENTS_SQL, INSERT_QUEUE_EVENTS_SQL, SLA_SECOND_MS,
};
use super::row::{LedgerRow, SignalsRow};
use postgres::types::ToSql;
use postgres::NoTls;
use r2d2_postgres::PostgresConnectionManager;
use sha2::{Digest, Sha256};
use sluice_record::decision::RecentFilter;
use sluice_record::{Failure, QueueOutcome, Verdict};
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

pub type PgPool = r2d2::Pool<PostgresConnectionManager<NoTls>>;

/// A write waiting this long (a lock held elsewhere) fails and the rows are retried or spooled.
pub const WRITE_STATEMENT_TIMEOUT_MS: u64 = 15_000;
pub const READ_STATEMENT_TIMEOUT_MS: u64 = 2_000;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a read waits for a pooled connection before answering "unreachable".
const READ_CHECKOUT: Duration = Duration::from_millis(800);
/// `/decisions/recent` never returns more than this.
pub const MAX_RECENT: usize = 1000;

/// Why an INSERT did not commit.
#[derive(Debug, Clone, PartialEq)]
pub enum InsertError {
    /// PostgreSQL could not be reached or did not answer in time: retry later, spool meanwhile.
    Unavailable(String),
    /// PostgreSQL refused the data itself (SQLSTATE class 22 data exception, 23 integrity, 54
    /// limit exceeded): retrying the same batch would fail forever.
    Rejected(String),
}

impl std::fmt::Display for InsertError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InsertError::Unavailable(e) | InsertError::Rejected(e) => f.write_str(e),
        }
    }
}

fn insert_error(e: postgres::Error) -> InsertError {
    let rejected = e.code().is_some_and(|c| {
        ["22", "23", "54"]
            .iter()
            .any(|class| c.code().starts_with(class))
    });
    if rejected {
        InsertError::Rejected(e.to_string())
    } else {
        InsertError::Unavailable(e.to_string())
    }
}

/// Completed proxied requests in the SLA window, per tier and in total.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlaWindow {
    pub completed: u64,
    pub violated: u64,
    /// tier → (completed, violated)
    pub per_tier: BTreeMap<String, (u64, u64)>,
}

impl SlaWindow {
    fn add(&mut self, tier: String, completed: i64, violated: i64) {
        let (c, v) = (completed.max(0) as u64, violated.max(0) as u64);
        self.completed += c;
        self.violated += v;
        let t = self.per_tier.entry(tier).or_default();
        t.0 += c;
        t.1 += v;
    }

    /// Violations among completed requests; an idle window has violated nothing.
    pub fn rate(&self) -> f64 {
        if self.completed == 0 {
            0.0
        } else {
            self.violated as f64 / self.completed as f64
        }
    }
}

#[derive(Clone)]
pub struct Db {
    write: PgPool,
    read: PgPool,
    schema: String,
    insert_sql: String,
    copy_sql: String,
    sla_seconds_sql: String,
    identity: String,
}

fn pool(
    base: &postgres::Config,
    schema: &str,
    statement_timeout_ms: u64,
    max_size: u32,
    extra: &str,
) -> PgPool {
    let mut cfg = base.clone();
    let options = format!(
        "{} -c search_path={schema} -c statement_timeout={statement_timeout_ms}{extra}",
        base.get_options().unwrap_or("")
    );
    cfg.options(options.trim())
        .connect_timeout(CONNECT_TIMEOUT)
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3);
    if cfg.get_application_name().is_none() {
        cfg.application_name("sluice-ledger");
    }
    // Connections are made on first use, not here: the proxy must start while PostgreSQL is
    // down. Errors are reported by the ledger itself (as JSON lines), not by r2d2's logger.
    r2d2::Pool::builder()
        .max_size(max_size)
        .min_idle(Some(0))
        .connection_timeout(CONNECT_TIMEOUT)
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .build_unchecked(PostgresConnectionManager::new(cfg, NoTls))
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Db {
    /// Parses the URL and prepares the pools without connecting. `schema` must be validated.
    pub fn new(url: &str, schema: &str) -> Result<Db, String> {
        Db::with_commit(url, schema, true)
    }

    /// [`Db::new`], choosing whether the writer's commits wait for the WAL flush
    /// (`ledger.synchronous_commit`; see the README's ledger section for the trade-off).
    pub fn with_commit(url: &str, schema: &str, synchronous_commit: bool) -> Result<Db, String> {
        let base: postgres::Config = url
            .parse()
            .map_err(|e| format!("database_url is not a usable PostgreSQL URL: {e}"))?;
        let identity = format!(
            "{:?}|{:?}|{:?}|{:?}|{schema}",
            base.get_hosts(),
            base.get_ports(),
            base.get_dbname(),
            base.get_user()
        );
        let commit = if synchronous_commit {
            ""
        } else {
            " -c synchronous_commit=off"
        };
        Ok(Db {
            write: pool(&base, schema, WRITE_STATEMENT_TIMEOUT_MS, 2, commit),
            read: pool(&base, schema, READ_STATEMENT_TIMEOUT_MS, 4, ""),
            schema: schema.to_string(),
            insert_sql: insert_decisions_sql(),
            copy_sql: copy_decisions_sql(),
            sla_seconds_sql: add_sla_seconds_sql(),
            identity,
        })
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// A short stable name for this database and schema, for the spool's file names.
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(self.identity.as_bytes());
        digest[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn migrate(&self) -> Result<Vec<i32>, String> {
        let mut c = self.write.get().map_err(err)?;
        super::migrate::run(&mut c, &self.schema).map_err(err)
    }

    /// Writes a batch of fresh rows (never written before) with binary `COPY`, in one
    /// transaction with its queue events and its completions' per-second counts; returns the
    /// rows written. A row already present (a client that reused an `x-request-id` within the
    /// same millisecond) fails the whole `COPY` as [`InsertError::Rejected`]: the caller then
    /// falls back to [`Db::insert`].
    pub fn copy(&self, batch: &CopyBatch) -> Result<u64, InsertError> {
        if batch.rows() == 0 {
            return Ok(0);
        }
        let mut c = self
            .write
            .get()
            .map_err(|e| InsertError::Unavailable(e.to_string()))?;
        // The writer buffers what it is given and sends it on `finish`, where PostgreSQL's
        // verdict arrives; a send that fails earlier carries the driver's error inside.
        let copy = |w: &mut postgres::CopyInWriter<'_>, data: &[u8]| {
            w.write_all(data).map_err(|e| {
                let msg = e.to_string();
                match e
                    .into_inner()
                    .and_then(|inner| inner.downcast::<postgres::Error>().ok())
                {
                    Some(pg) => insert_error(*pg),
                    None => InsertError::Unavailable(msg),
                }
            })
        };
        let mut tx = c.transaction().map_err(insert_error)?;
        let mut w = tx.copy_in(self.copy_sql.as_str()).map_err(insert_error)?;
        copy(&mut w, batch.decisions())?;
        let n = w.finish().map_err(insert_error)?;
        if batch.queue_event_count() > 0 {
            let mut w = tx.copy_in(COPY_QUEUE_EVENTS_SQL).map_err(insert_error)?;
            copy(&mut w, batch.queue_events())?;
            w.finish().map_err(insert_error)?;
        }
        // Last, so the counts' row locks (the current second's, which every replica updates)
        // are held only for the commit.
        let (seconds, tiers, completed, violated) = batch.sla_seconds();
        if !seconds.is_empty() {
            tx.execute(
                self.sla_seconds_sql.as_str(),
                &[&seconds, &tiers, &completed, &violated],
            )
            .map_err(insert_error)?;
        }
        tx.commit().map_err(insert_error)?;
        Ok(n)
    }

    /// Inserts a batch and its queue events in one transaction; returns the rows that were new
    /// (a replayed row already present is skipped).
    pub fn insert<R: Borrow<LedgerRow>>(&self, rows: &[R]) -> Result<u64, InsertError> {
        if rows.is_empty() {
            return Ok(0);
        }
        let mut c = self
            .write
            .get()
            .map_err(|e| InsertError::Unavailable(e.to_string()))?;
        let batch = Batch::build(rows);
        let mut tx = c.transaction().map_err(insert_error)?;
        let n: i64 = tx
            .query_one(self.insert_sql.as_str(), &batch.decision_params())
            .and_then(|r| r.try_get(0))
            .map_err(insert_error)?;
        let n = n.max(0) as u64;
        if batch.queue_event_count() > 0 {
            tx.execute(INSERT_QUEUE_EVENTS_SQL, &batch.queue_event_params())
                .map_err(insert_error)?;
        }
        tx.commit().map_err(insert_error)?;
        Ok(n)
    }

    /// `/decisions/recent`: newest first, the filters that are set, at most [`MAX_RECENT`].
    pub fn recent(&self, f: &RecentFilter) -> Result<Vec<serde_json::Value>, String> {
        let since = f.since_ms.map(|s| i64::try_from(s).unwrap_or(i64::MAX));
        let limit = f.limit.min(MAX_RECENT) as i64;
        let mut conds = Vec::new();
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::new();
        for (column, value) in [
            ("tenant", f.tenant.as_ref()),
            ("tier", f.tier.as_ref()),
            ("decision", f.decision.as_ref()),
        ] {
            if let Some(v) = value {
                params.push(v);
                conds.push(format!("{column} = ${}", params.len()));
            }
        }
        if let Some(s) = &since {
            params.push(s);
            conds.push(format!("received_at_ms >= ${}", params.len()));
        }
        params.push(&limit);
        let filter = if conds.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", conds.join(" AND "))
        };
        let sql = format!(
            "SELECT {} FROM decisions {filter} ORDER BY received_at_ms DESC, request_id DESC LIMIT ${}",
            decision_column_list(),
            params.len()
        );
        let mut c = self.read.get_timeout(READ_CHECKOUT).map_err(err)?;
        let rows = c.query(sql.as_str(), &params).map_err(err)?;
        rows.iter()
            .map(|r| {
                let row = row_of(r).map_err(err)?;
                serde_json::to_value(row).map_err(err)
            })
            .collect()
    }

    /// Completed proxied requests (`sla_violated` set) that finished at or after `since_ms`,
    /// at most the newest `last_n` of them.
    ///
    /// Whole seconds come from `sla_seconds` (one row per second and tier, added to by the
    /// writer in the rows' own transactions); only the window's partial first second is counted
    /// row by row. With `last_n`, seconds are taken newest first until the cap falls inside one, whose
    /// newest rows are then read one by one: exact, and never a scan of the whole window.
    pub fn sla_window(&self, since_ms: u64, last_n: Option<u64>) -> Result<SlaWindow, String> {
        let whole_from = since_ms
            .div_ceil(SLA_SECOND_MS)
            .saturating_mul(SLA_SECOND_MS);
        let since = i64::try_from(since_ms).unwrap_or(i64::MAX);
        let whole = i64::try_from(whole_from).unwrap_or(i64::MAX);
        let mut c = self.read.get_timeout(READ_CHECKOUT).map_err(err)?;
        let mut w = SlaWindow::default();
        let Some(cap) = last_n else {
            // One statement, so the seconds and the edge's rows come from one snapshot.
            let rows = c
                .query(
                    "SELECT tier, sum(completed)::int8, sum(violated)::int8 FROM (
                         SELECT tier, completed, violated FROM sla_seconds WHERE second_ms >= $2
                         UNION ALL
                         SELECT tier, 1, sla_violated::int FROM decisions
                         WHERE sla_violated IS NOT NULL
                           AND completed_at_ms >= $1 AND completed_at_ms < $2
                     ) w GROUP BY tier",
                    &[&since, &whole],
                )
                .map_err(err)?;
            for r in rows {
                w.add(
                    r.try_get(0).map_err(err)?,
                    r.try_get(1).map_err(err)?,
                    r.try_get(2).map_err(err)?,
                );
            }
            return Ok(w);
        };
        let mut tx = c
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(err)?;
        let seconds = tx
            .query(
                "SELECT second_ms, tier, completed, violated FROM sla_seconds
                 WHERE second_ms >= $1 ORDER BY second_ms DESC, tier",
                &[&whole],
            )
            .map_err(err)?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
            .collect::<Result<Vec<(i64, String, i64, i64)>, postgres::Error>>()
            .map_err(err)?;
        // The newest rows of [from, to), at most `left` of them; among rows completed in the
        // same millisecond, the first written (as the scan of the previous index had them).
        let newest = |tx: &mut postgres::Transaction<'_>, from: i64, to: i64, left: u64| {
            let limit = i64::try_from(left).unwrap_or(i64::MAX);
            tx.query(
                "SELECT tier, sla_violated::int::int8 FROM decisions
                 WHERE sla_violated IS NOT NULL AND completed_at_ms >= $1 AND completed_at_ms < $2
                 ORDER BY completed_at_ms DESC, ctid LIMIT $3",
                &[&from, &to, &limit],
            )
        };
        let mut left = cap;
        for second in seconds.chunk_by(|a, b| a.0 == b.0) {
            if left == 0 {
                break;
            }
            let total: u64 = second.iter().map(|s| s.2.max(0) as u64).sum();
            if total <= left {
                for (_, tier, completed, violated) in second {
                    w.add(tier.clone(), *completed, *violated);
                }
                left -= total;
            } else {
                let from = second[0].0;
                let to = from.saturating_add(SLA_SECOND_MS as i64);
                for r in newest(&mut tx, from, to, left).map_err(err)? {
                    w.add(r.try_get(0).map_err(err)?, 1, r.try_get(1).map_err(err)?);
                }
                left = 0;
            }
        }
        if left > 0 && since < whole {
            for r in newest(&mut tx, since, whole, left).map_err(err)? {
                w.add(r.try_get(0).map_err(err)?, 1, r.try_get(1).map_err(err)?);
            }
        }
        tx.commit().map_err(err)?;
        Ok(w)
    }

    /// Deletes the SLA window's per-second counts older than `cutoff_ms`; returns how many.
    pub fn delete_sla_seconds_before(&self, cutoff_ms: u64) -> Result<u64, String> {
        let cutoff = i64::try_from(cutoff_ms).unwrap_or(i64::MAX);
        let mut c = self.write.get().map_err(err)?;
        c.execute("DELETE FROM sla_seconds WHERE second_ms < $1", &[&cutoff])
            .map_err(err)
    }

    /// Deletes at most `batch` decision rows (and at most `batch` queue events) received before
    /// `cutoff_ms`; returns how many were deleted. Small batches keep each transaction short,
    /// so retention never holds up the writer.
    pub fn delete_older_than(&self, cutoff_ms: u64, batch: i64) -> Result<u64, String> {
        let cutoff = i64::try_from(cutoff_ms).unwrap_or(i64::MAX);
        let mut c = self.write.get().map_err(err)?;
        let mut deleted = 0;
        for table in ["decisions", "queue_events"] {
            deleted += c
                .execute(
                    format!(
                        "DELETE FROM {table} WHERE ctid = ANY(ARRAY(
                             SELECT ctid FROM {table} WHERE received_at_ms < $1
                             ORDER BY received_at_ms LIMIT $2))"
                    )
                    .as_str(),
                    &[&cutoff, &batch],
                )
                .map_err(err)?;
        }
        Ok(deleted)
    }
}

pub(super) fn row_of(r: &postgres::Row) -> Result<LedgerRow, postgres::Error> {
    let u64_of = |v: Option<i64>| v.map(|v| v.max(0) as u64);
    Ok(LedgerRow {
        request_id: r.try_get("request_id")?,
        received_at_ms: r.try_get::<_, i64>("received_at_ms")?.max(0) as u64,
        replica: r.try_get::<_, String>("replica")?.into(),
        tenant: r.try_get("tenant")?,
        tier: r.try_get::<_, String>("tier")?.into(),
        method: r.try_get::<_, String>("method")?.into(),
        path: r.try_get::<_, String>("path")?.into(),
        // A code this build does not know reads as its nearest: the row stays readable.
        decision: Verdict::parse(&r.try_get::<_, String>("decision")?).unwrap_or(Verdict::Error),
        reason: r.try_get::<_, String>("reason")?.into(),
        state: r.try_get::<_, String>("state")?.into(),
        pool: r.try_get::<_, Option<String>>("pool")?.map(Into::into),
        route_reason: r
            .try_get::<_, Option<String>>("route_reason")?
            .map(Into::into),
        backend: r.try_get::<_, Option<String>>("backend")?.map(Into::into),
        requested_model: r.try_get("requested_model")?,
        routed_model: r.try_get("routed_model")?,
        requested_max_tokens: r.try_get("requested_max_tokens")?,
        applied_max_tokens: r.try_get("applied_max_tokens")?,
        stream: r.try_get("stream")?,
        queue_wait_ms: r.try_get("queue_wait_ms")?,
        status: u16::try_from(r.try_get::<_, i32>("status")?).unwrap_or(0),
        latency_ms: r.try_get("latency_ms")?,
        ttfb_ms: r.try_get("ttfb_ms")?,
        overhead_us: r.try_get("overhead_us")?,
        prompt_tokens: u64_of(r.try_get("prompt_tokens")?),
        completion_tokens: u64_of(r.try_get("completion_tokens")?),
        sla_target_ms: u64_of(r.try_get("sla_target_ms")?),
        sla_violated: r.try_get("sla_violated")?,
        ttft_ms: r.try_get("ttft_ms")?,
        tpot_ms: r.try_get("tpot_ms")?,
        ttft_target_ms: u64_of(r.try_get("ttft_target_ms")?),
        tpot_target_ms: u64_of(r.try_get("tpot_target_ms")?),
        attempts: u64_of(r.try_get("attempts")?),
        tried: r.try_get::<_, Option<String>>("tried")?.map(Into::into),
        trace_id: r.try_get::<_, Option<String>>("trace_id")?.map(Into::into),
        slo_missed: r
            .try_get::<_, Option<String>>("slo_missed")?
            .map(Into::into),
        signals: SignalsRow {
            pressure: r.try_get("signal_pressure")?,
            queue_depth: r.try_get("signal_queue_depth")?,
            sla_violation_rate: r.try_get("signal_sla_violation_rate")?,
        },
        queue_outcome: r
            .try_get::<_, Option<String>>("queue_outcome")?
            .and_then(|q| QueueOutcome::parse(&q)),
        error: r
            .try_get::<_, Option<String>>("error")?
            .map(|e| Failure::parse(&e).unwrap_or(Failure::InternalError)),
        // Inputs this build cannot read leave the row without them (replay counts it).
        inputs: r
            .try_get::<_, Option<StoredInputs>>("inputs")?
            .and_then(|i| i.0),
    })
}
