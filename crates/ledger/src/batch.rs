//! Batch building, two ways from one column table:
//!
//! * [`CopyBatch`]: fresh rows (from the buffer, never written before) as one binary
//!   `COPY … FROM STDIN (FORMAT binary)` per table, encoded into buffers the writer reuses. The
//!   cheapest way into PostgreSQL: no statement to parse and plan per batch, no array unnesting,
//!   heap pages filled several rows per WAL record, no `ON CONFLICT` probe per row.
//! * [`Batch`]: one array per column, sent as `INSERT … SELECT * FROM unnest($1::text[], …)
//!   ON CONFLICT … DO NOTHING`, for rows that may already be there (a spool replay) and as the
//!   fallback when a `COPY` is refused (a client reused an `x-request-id` within the same
//!   millisecond). One statement per batch, a fixed number of parameters whatever the batch size.
//!
//! The column table below is the only place a column is named: the SQL, the parameter list and
//! the `COPY` encoding are all generated from it, so they cannot drift apart.

use super::row::LedgerRow;
use postgres::types::{FromSql, ToSql, Type};
use sluice_record::PolicyInputs;
use std::borrow::Borrow;

/// How to read one column out of a row; the variant fixes the SQL array type.
#[derive(Clone, Copy)]
enum Extract {
    Text(fn(&LedgerRow) -> Option<&str>),
    Int8(fn(&LedgerRow) -> Option<i64>),
    Int4(fn(&LedgerRow) -> i32),
    Float8(fn(&LedgerRow) -> Option<f64>),
    Bool(fn(&LedgerRow) -> Option<bool>),
    /// The replay inputs as `bytea` ([`sluice_record::binary`]), encoded here, on the writer's
    /// thread, not on the request path.
    Inputs(fn(&LedgerRow) -> Option<&PolicyInputs>),
}

/// The `inputs` column read back: `bytea` since migration 0004, `json` or `jsonb` in a schema a
/// running Sluice has not migrated yet (an export reads any of them); the `postgres` crate's own
/// JSON support is a feature this build does not enable. `jsonb`'s binary format is a version
/// byte, 1, then the text; `json`'s and `bytea`'s are the bytes themselves. `None` when this
/// build cannot read them (replay counts the row).
#[derive(Debug)]
pub struct StoredInputs(pub Option<PolicyInputs>);

impl<'a> FromSql<'a> for StoredInputs {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let bytes = if *ty == Type::JSONB {
            match raw.split_first() {
                Some((1, text)) => text,
                _ => return Err("unsupported jsonb format version".into()),
            }
        } else {
            raw
        };
        Ok(StoredInputs(sluice_record::binary::decode(bytes)))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::BYTEA || *ty == Type::JSON || *ty == Type::JSONB
    }
}

/// The `unnest` path's parameter.
fn inputs_bytes(v: Option<&PolicyInputs>) -> Option<Vec<u8>> {
    v.map(|i| {
        let mut out = Vec::with_capacity(96);
        sluice_record::binary::encode(&mut out, i);
        out
    })
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `decisions` columns in table order (see `migrations/`).
const DECISION_COLUMNS: &[(&str, Extract)] = &[
    ("request_id", Extract::Text(|r| Some(&r.request_id))),
    (
        "received_at_ms",
        Extract::Int8(|r| Some(i64_of(r.received_at_ms))),
    ),
    (
        "completed_at_ms",
        Extract::Int8(|r| Some(i64_of(r.completed_at_ms()))),
    ),
    ("replica", Extract::Text(|r| Some(&r.replica))),
    ("tenant", Extract::Text(|r| Some(&r.tenant))),
    ("tier", Extract::Text(|r| Some(&r.tier))),
    ("method", Extract::Text(|r| Some(&r.method))),
    ("path", Extract::Text(|r| Some(&r.path))),
    ("decision", Extract::Text(|r| Some(r.decision.as_str()))),
    ("reason", Extract::Text(|r| Some(&r.reason))),
    ("state", Extract::Text(|r| Some(&r.state))),
    ("pool", Extract::Text(|r| r.pool.as_deref())),
    ("route_reason", Extract::Text(|r| r.route_reason.as_deref())),
    ("backend", Extract::Text(|r| r.backend.as_deref())),
    (
        "requested_model",
        Extract::Text(|r| r.requested_model.as_deref()),
    ),
    ("routed_model", Extract::Text(|r| r.routed_model.as_deref())),
    (
        "requested_max_tokens",
        Extract::Int8(|r| r.requested_max_tokens),
    ),
    (
        "applied_max_tokens",
        Extract::Int8(|r| r.applied_max_tokens),
    ),
    ("stream", Extract::Bool(|r| Some(r.stream))),
    ("queue_wait_ms", Extract::Float8(|r| r.queue_wait_ms)),
    ("status", Extract::Int4(|r| i32::from(r.status))),
    ("latency_ms", Extract::Float8(|r| Some(r.latency_ms))),
    ("ttfb_ms", Extract::Float8(|r| r.ttfb_ms)),
    ("overhead_us", Extract::Float8(|r| r.overhead_us)),
    (
        "prompt_tokens",
        Extract::Int8(|r| r.prompt_tokens.map(i64_of)),
    ),
    (
        "completion_tokens",
        Extract::Int8(|r| r.completion_tokens.map(i64_of)),
    ),
    (
        "sla_target_ms",
        Extract::Int8(|r| r.sla_target_ms.map(i64_of)),
    ),
    ("sla_violated", Extract::Bool(|r| r.sla_violated)),
    ("ttft_ms", Extract::Float8(|r| r.ttft_ms)),
    ("tpot_ms", Extract::Float8(|r| r.tpot_ms)),
    (
        "ttft_target_ms",
        Extract::Int8(|r| r.ttft_target_ms.map(i64_of)),
    ),
    (
        "tpot_target_ms",
        Extract::Int8(|r| r.tpot_target_ms.map(i64_of)),
    ),
    ("slo_missed", Extract::Text(|r| r.slo_missed.as_deref())),
    ("attempts", Extract::Int8(|r| r.attempts.map(i64_of))),
    ("tried", Extract::Text(|r| r.tried.as_deref())),
    ("trace_id", Extract::Text(|r| r.trace_id.as_deref())),
    ("signal_pressure", Extract::Float8(|r| r.signals.pressure)),
    (
        "signal_queue_depth",
        Extract::Float8(|r| r.signals.queue_depth),
    ),
    (
        "signal_sla_violation_rate",
        Extract::Float8(|r| r.signals.sla_violation_rate),
    ),
    (
        "queue_outcome",
        Extract::Text(|r| r.queue_outcome.map(|q| q.as_str())),
    ),
    ("error", Extract::Text(|r| r.error.map(|e| e.as_str()))),
    ("inputs", Extract::Inputs(|r| r.inputs.as_ref())),
];

/// The columns `/decisions/recent` selects, in the order [`DECISION_COLUMNS`] has them.
pub fn decision_column_list() -> String {
    DECISION_COLUMNS
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One column's values for a whole batch.
enum Column<'a> {
    Text(Vec<Option<&'a str>>),
    Int8(Vec<Option<i64>>),
    Int4(Vec<i32>),
    Float8(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
    Inputs(Vec<Option<Vec<u8>>>),
}

impl<'a> Column<'a> {
    fn build<R: Borrow<LedgerRow>>(extract: Extract, rows: &'a [R]) -> Self {
        let rows = rows.iter().map(|r| r.borrow());
        match extract {
            Extract::Text(f) => Column::Text(rows.map(f).collect()),
            Extract::Int8(f) => Column::Int8(rows.map(f).collect()),
            Extract::Int4(f) => Column::Int4(rows.map(f).collect()),
            Extract::Float8(f) => Column::Float8(rows.map(f).collect()),
            Extract::Bool(f) => Column::Bool(rows.map(f).collect()),
            Extract::Inputs(f) => Column::Inputs(rows.map(|r| inputs_bytes(f(r))).collect()),
        }
    }

    fn param(&self) -> &(dyn ToSql + Sync) {
        match self {
            Column::Text(v) => v,
            Column::Int8(v) => v,
            Column::Int4(v) => v,
            Column::Float8(v) => v,
            Column::Bool(v) => v,
            Column::Inputs(v) => v,
        }
    }
}

fn sql_type(extract: &Extract) -> &'static str {
    match extract {
        Extract::Text(_) => "text",
        Extract::Int8(_) => "int8",
        Extract::Int4(_) => "int4",
        Extract::Float8(_) => "float8",
        Extract::Bool(_) => "bool",
        Extract::Inputs(_) => "bytea",
    }
}

/// The batch INSERT into `decisions` alone, skipping rows already there (what Sluice ran before
/// migration 3 kept `sla_seconds`).
pub fn insert_rows_sql() -> String {
    let names = decision_column_list();
    let arrays: Vec<String> = DECISION_COLUMNS
        .iter()
        .enumerate()
        .map(|(i, (_, e))| format!("${}::{}[]", i + 1, sql_type(e)))
        .collect();
    format!(
        "INSERT INTO decisions ({names}) SELECT * FROM unnest({}) \
         ON CONFLICT (request_id, received_at_ms) DO NOTHING",
        arrays.join(", ")
    )
}

/// The batch INSERT into `decisions` as the writer runs it: skips rows already there, adds the
/// completions it did insert (only those: a replayed row is not counted twice) to
/// `sla_seconds`, and answers one row, one column: how many it inserted.
pub fn insert_decisions_sql() -> String {
    format!(
        "WITH ins AS ({} RETURNING completed_at_ms, tier, sla_violated), \
         counted AS (INSERT INTO sla_seconds AS s (second_ms, tier, completed, violated) \
             SELECT completed_at_ms / 1000 * 1000, tier, count(*), \
                    count(*) FILTER (WHERE sla_violated) \
             FROM ins WHERE sla_violated IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2 \
             {SLA_SECONDS_ON_CONFLICT}) \
         SELECT count(*) FROM ins",
        insert_rows_sql()
    )
}

const SLA_SECONDS_ON_CONFLICT: &str = "ON CONFLICT (second_ms, tier) DO UPDATE \
     SET completed = s.completed + excluded.completed, violated = s.violated + excluded.violated";

/// Adds a `COPY`'s completions to `sla_seconds`: (second, tier, completed, violated) arrays in
/// key order, so two writers updating the same seconds take their row locks in the same order
/// and cannot deadlock.
pub fn add_sla_seconds_sql() -> String {
    format!(
        "INSERT INTO sla_seconds AS s (second_ms, tier, completed, violated) \
         SELECT * FROM unnest($1::int8[], $2::text[], $3::int8[], $4::int8[]) ORDER BY 1, 2 \
         {SLA_SECONDS_ON_CONFLICT}"
    )
}

/// The width of the SLA window's per-tier counts (`sla_seconds`, migration 3).
pub const SLA_SECOND_MS: u64 = 1000;

/// The batch INSERT into `queue_events`.
pub const INSERT_QUEUE_EVENTS_SQL: &str = "INSERT INTO queue_events \
     (request_id, received_at_ms, event, at_ms, wait_ms, tenant, tier) \
     SELECT * FROM unnest($1::text[], $2::int8[], $3::text[], $4::int8[], $5::float8[], \
     $6::text[], $7::text[]) \
     ON CONFLICT (request_id, received_at_ms, event) DO NOTHING";

/// One batch, ready to bind: the decision columns and the queue events derived from the rows.
pub struct Batch<'a> {
    columns: Vec<Column<'a>>,
    ev_request_id: Vec<&'a str>,
    ev_received_at_ms: Vec<i64>,
    ev_event: Vec<&'static str>,
    ev_at_ms: Vec<i64>,
    ev_wait_ms: Vec<Option<f64>>,
    ev_tenant: Vec<&'a str>,
    ev_tier: Vec<&'a str>,
}

impl<'a> Batch<'a> {
    pub fn build<R: Borrow<LedgerRow>>(rows: &'a [R]) -> Self {
        let columns = DECISION_COLUMNS
            .iter()
            .map(|(_, e)| Column::build(*e, rows))
            .collect();
        let mut b = Batch {
            columns,
            ev_request_id: Vec::new(),
            ev_received_at_ms: Vec::new(),
            ev_event: Vec::new(),
            ev_at_ms: Vec::new(),
            ev_wait_ms: Vec::new(),
            ev_tenant: Vec::new(),
            ev_tier: Vec::new(),
        };
        for row in rows {
            let row: &'a LedgerRow = row.borrow();
            for ev in row.queue_events() {
                b.ev_request_id.push(&row.request_id);
                b.ev_received_at_ms.push(i64_of(row.received_at_ms));
                b.ev_event.push(ev.event);
                b.ev_at_ms.push(i64_of(ev.at_ms));
                b.ev_wait_ms.push(ev.wait_ms);
                b.ev_tenant.push(&row.tenant);
                b.ev_tier.push(&row.tier);
            }
        }
        b
    }

    pub fn decision_params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.columns.iter().map(Column::param).collect()
    }

    pub fn queue_event_count(&self) -> usize {
        self.ev_event.len()
    }

    pub fn queue_event_params(&self) -> [&(dyn ToSql + Sync); 7] {
        [
            &self.ev_request_id,
            &self.ev_received_at_ms,
            &self.ev_event,
            &self.ev_at_ms,
            &self.ev_wait_ms,
            &self.ev_tenant,
            &self.ev_tier,
        ]
    }
}

/// `COPY decisions … FROM STDIN (FORMAT binary)`, the columns in [`DECISION_COLUMNS`]' order.
pub fn copy_decisions_sql() -> String {
    format!(
        "COPY decisions ({}) FROM STDIN (FORMAT binary)",
        decision_column_list()
    )
}

/// `COPY queue_events … FROM STDIN (FORMAT binary)`, the columns in [`CopyBatch`]'s order.
pub const COPY_QUEUE_EVENTS_SQL: &str = "COPY queue_events \
     (request_id, received_at_ms, event, at_ms, wait_ms, tenant, tier) FROM STDIN (FORMAT binary)";

/// The binary COPY signature, flags and (empty) header extension.
const COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
const COPY_TRAILER: &[u8] = &(-1i16).to_be_bytes();
/// PostgreSQL refuses a field over 1 GB; a longer one (never: request bodies are bounded far
/// below) is cut here so the stream stays well-formed, and PostgreSQL refuses the row.
const MAX_FIELD: usize = 1 << 30;

/// A batch of fresh rows encoded for binary `COPY`: one buffer per table, cleared and reused
/// from batch to batch so encoding allocates nothing once the buffers have grown.
#[derive(Default)]
pub struct CopyBatch {
    decisions: Vec<u8>,
    queue_events: Vec<u8>,
    rows: usize,
    events: usize,
    /// (second, tier, completed, violated) of the rows with `sla_violated` set: what the batch
    /// adds to `sla_seconds`. A batch spans a few seconds and tiers: a short list, no map.
    seconds: Vec<(i64, sluice_record::decision::Text, i64, i64)>,
}

fn put_len(buf: &mut Vec<u8>, n: usize) {
    buf.extend_from_slice(&(n.min(MAX_FIELD) as i32).to_be_bytes());
}

fn put_null(buf: &mut Vec<u8>) {
    buf.extend_from_slice(&(-1i32).to_be_bytes());
}

fn put_text(buf: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => {
            let b = &s.as_bytes()[..s.len().min(MAX_FIELD)];
            put_len(buf, b.len());
            buf.extend_from_slice(b);
        }
        None => put_null(buf),
    }
}

/// The replay inputs' `bytea` field, encoded straight into the buffer: no allocation per row.
fn put_inputs(buf: &mut Vec<u8>, v: Option<&PolicyInputs>) {
    let Some(v) = v else {
        return put_null(buf);
    };
    let at = buf.len();
    buf.extend_from_slice(&[0, 0, 0, 0]);
    sluice_record::binary::encode(buf, v);
    let len = (buf.len() - at - 4) as i32;
    buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_fixed<const N: usize>(buf: &mut Vec<u8>, v: Option<[u8; N]>) {
    match v {
        Some(b) => {
            put_len(buf, N);
            buf.extend_from_slice(&b);
        }
        None => put_null(buf),
    }
}

impl CopyBatch {
    /// Encodes `rows` (and their queue events), replacing the previous batch.
    pub fn encode<R: Borrow<LedgerRow>>(&mut self, rows: &[R]) {
        self.decisions.clear();
        self.queue_events.clear();
        self.rows = rows.len();
        self.events = 0;
        self.seconds.clear();
        let buf = &mut self.decisions;
        buf.extend_from_slice(COPY_HEADER);
        let fields = (DECISION_COLUMNS.len() as i16).to_be_bytes();
        for row in rows {
            let row = row.borrow();
            buf.extend_from_slice(&fields);
            for (_, extract) in DECISION_COLUMNS {
                match *extract {
                    Extract::Text(f) => put_text(buf, f(row)),
                    Extract::Int8(f) => put_fixed(buf, f(row).map(i64::to_be_bytes)),
                    Extract::Int4(f) => put_fixed(buf, Some(f(row).to_be_bytes())),
                    Extract::Float8(f) => put_fixed(buf, f(row).map(f64::to_be_bytes)),
                    Extract::Bool(f) => put_fixed(buf, f(row).map(|b| [u8::from(b)])),
                    Extract::Inputs(f) => put_inputs(buf, f(row)),
                }
            }
        }
        buf.extend_from_slice(COPY_TRAILER);
        for row in rows {
            let row = row.borrow();
            if let Some(violated) = row.sla_violated {
                let second = i64_of(row.completed_at_ms() / SLA_SECOND_MS * SLA_SECOND_MS);
                let at = match self
                    .seconds
                    .iter()
                    .rposition(|s| s.0 == second && s.1 == row.tier)
                {
                    Some(at) => at,
                    None => {
                        self.seconds.push((second, row.tier.clone(), 0, 0));
                        self.seconds.len() - 1
                    }
                };
                self.seconds[at].2 += 1;
                self.seconds[at].3 += i64::from(violated);
            }
            if row.queue_outcome.is_none() && row.queue_wait_ms.is_none() {
                continue;
            }
            let ev_buf = &mut self.queue_events;
            if ev_buf.is_empty() {
                ev_buf.extend_from_slice(COPY_HEADER);
            }
            for ev in row.queue_events() {
                ev_buf.extend_from_slice(&7i16.to_be_bytes());
                put_text(ev_buf, Some(&row.request_id));
                put_fixed(ev_buf, Some(i64_of(row.received_at_ms).to_be_bytes()));
                put_text(ev_buf, Some(ev.event));
                put_fixed(ev_buf, Some(i64_of(ev.at_ms).to_be_bytes()));
                put_fixed(ev_buf, ev.wait_ms.map(f64::to_be_bytes));
                put_text(ev_buf, Some(&row.tenant));
                put_text(ev_buf, Some(&row.tier));
                self.events += 1;
            }
        }
        if self.events > 0 {
            self.queue_events.extend_from_slice(COPY_TRAILER);
        }
        self.seconds
            .sort_unstable_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// What the batch adds to `sla_seconds`: second, tier, completed and violated, in key order.
    pub fn sla_seconds(&self) -> (Vec<i64>, Vec<&str>, Vec<i64>, Vec<i64>) {
        let mut out = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (second, tier, completed, violated) in &self.seconds {
            out.0.push(*second);
            out.1.push(&**tier);
            out.2.push(*completed);
            out.3.push(*violated);
        }
        out
    }

    /// The `decisions` COPY data (header, rows, trailer).
    pub fn decisions(&self) -> &[u8] {
        &self.decisions
    }

    pub fn queue_event_count(&self) -> usize {
        self.events
    }

    /// The `queue_events` COPY data; empty when no row met the queue.
    pub fn queue_events(&self) -> &[u8] {
        if self.events == 0 {
            &[]
        } else {
            &self.queue_events
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, queue: Option<(&str, Option<f64>)>) -> LedgerRow {
        LedgerRow {
            request_id: id.into(),
            received_at_ms: 1000,
            tenant: "t".into(),
            tier: "Standard".into(),
            status: 200,
            latency_ms: 10.0,
            queue_outcome: queue.and_then(|q| sluice_record::QueueOutcome::parse(q.0)),
            queue_wait_ms: queue.and_then(|q| q.1),
            ..Default::default()
        }
    }

    #[test]
    fn sql_and_parameters_come_from_one_table() {
        let sql = insert_decisions_sql();
        let n = DECISION_COLUMNS.len();
        assert_eq!(
            n, 42,
            "one column per DecisionRecord field, signals flattened, plus completed_at_ms"
        );
        assert!(sql.contains(&format!("${n}::bytea[]")));
        assert!(!sql.contains(&format!("${}::", n + 1)));
        let migrations = super::super::migrate::MIGRATIONS;
        for (name, _) in DECISION_COLUMNS {
            assert!(
                migrations
                    .iter()
                    .any(|m| m.2.contains(&format!("    {name} "))
                        || m.2.contains(&format!("ADD COLUMN {name} "))
                        || m.2.contains(&format!("ADD COLUMN IF NOT EXISTS {name} "))),
                "{name} in a migration"
            );
        }
        let rows = [row("a", None), row("b", None)];
        let batch = Batch::build(&rows);
        assert_eq!(batch.decision_params().len(), n);
    }

    #[test]
    fn queue_events_are_expanded_per_row() {
        let rows = [
            row("a", None),
            row("b", Some(("queue_released", Some(5.0)))),
            row("c", Some(("queue_dropped", None))),
        ];
        let batch = Batch::build(&rows);
        assert_eq!(batch.queue_event_count(), 3);
        assert_eq!(
            batch.ev_event,
            ["queue_queued", "queue_released", "queue_dropped"]
        );
        assert_eq!(batch.ev_request_id, ["b", "b", "c"]);
        assert_eq!(batch.ev_at_ms, [1000, 1005, 1000]);
    }

    /// Reads a binary COPY stream back: rows of fields, `None` for NULL.
    fn parse(mut b: &[u8]) -> Vec<Vec<Option<Vec<u8>>>> {
        assert_eq!(&b[..COPY_HEADER.len()], COPY_HEADER);
        b = &b[COPY_HEADER.len()..];
        let mut rows = Vec::new();
        loop {
            let n = i16::from_be_bytes([b[0], b[1]]);
            b = &b[2..];
            if n == -1 {
                assert!(b.is_empty(), "nothing after the trailer");
                return rows;
            }
            let mut row = Vec::new();
            for _ in 0..n {
                let len = i32::from_be_bytes(b[..4].try_into().unwrap());
                b = &b[4..];
                if len < 0 {
                    row.push(None);
                } else {
                    row.push(Some(b[..len as usize].to_vec()));
                    b = &b[len as usize..];
                }
            }
            rows.push(row);
        }
    }

    #[test]
    fn copy_encodes_every_column_in_table_order_and_reuses_its_buffers() {
        let mut a = row("a", Some(("queue_released", Some(5.0))));
        a.prompt_tokens = Some(42);
        a.stream = true;
        a.sla_violated = Some(false);
        let rows = [a, row("bb", None)];
        let mut copy = CopyBatch::default();
        copy.encode(&rows);
        let decoded = parse(copy.decisions());
        assert_eq!(decoded.len(), 2);
        assert!(decoded.iter().all(|r| r.len() == DECISION_COLUMNS.len()));
        let col = |name: &str| {
            DECISION_COLUMNS
                .iter()
                .position(|(n, _)| *n == name)
                .unwrap()
        };
        let r = &decoded[0];
        assert_eq!(r[col("request_id")].as_deref(), Some(&b"a"[..]));
        assert_eq!(
            r[col("received_at_ms")].as_deref(),
            Some(&1000i64.to_be_bytes()[..])
        );
        assert_eq!(
            r[col("completed_at_ms")].as_deref(),
            Some(&1010i64.to_be_bytes()[..])
        );
        assert_eq!(r[col("status")].as_deref(), Some(&200i32.to_be_bytes()[..]));
        assert_eq!(
            r[col("latency_ms")].as_deref(),
            Some(&10.0f64.to_be_bytes()[..])
        );
        assert_eq!(r[col("stream")].as_deref(), Some(&[1u8][..]));
        assert_eq!(r[col("sla_violated")].as_deref(), Some(&[0u8][..]));
        assert_eq!(
            r[col("prompt_tokens")].as_deref(),
            Some(&42i64.to_be_bytes()[..])
        );
        assert_eq!(r[col("pool")], None, "NULL");
        assert_eq!(decoded[1][col("queue_outcome")], None);

        assert_eq!(copy.queue_event_count(), 2);
        let events = parse(copy.queue_events());
        assert_eq!(events.len(), 2);
        assert_eq!(events[1][2].as_deref(), Some(&b"queue_released"[..]));
        assert_eq!(events[1][3].as_deref(), Some(&1005i64.to_be_bytes()[..]));
        assert_eq!(events[0][4], None, "queue_queued has no wait");

        // The next batch replaces this one; no queue events, no stream for them.
        let cap = copy.decisions.capacity();
        copy.encode(&rows[1..]);
        assert_eq!(parse(copy.decisions()).len(), 1);
        assert!(copy.queue_events().is_empty());
        assert_eq!(copy.decisions.capacity(), cap, "buffers are reused");
    }
}
