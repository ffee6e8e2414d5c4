//! Batch building: a slice of rows becomes one array per column, sent as
//! `INSERT … SELECT * FROM unnest($1::text[], $2::int8[], …)`. One statement per batch, a fixed
//! number of parameters whatever the batch size (a multi-row `VALUES` list would hit the 65535
//! bind-parameter limit at about 2000 rows), and `ON CONFLICT … DO NOTHING` keeps a replayed
//! spool idempotent, which `COPY` cannot do.
//!
//! The column table below is the only place a column is named: the SQL and the parameter list
//! are both generated from it, so they cannot drift apart.

use super::row::LedgerRow;
use postgres::types::{to_sql_checked, FromSql, IsNull, ToSql, Type};

/// How to read one column out of a row; the variant fixes the SQL array type.
#[derive(Clone, Copy)]
enum Extract {
    Text(fn(&LedgerRow) -> Option<&str>),
    Int8(fn(&LedgerRow) -> Option<i64>),
    Int4(fn(&LedgerRow) -> i32),
    Float8(fn(&LedgerRow) -> Option<f64>),
    Bool(fn(&LedgerRow) -> Option<bool>),
    /// Serialised here, on the writer's thread, not on the request path.
    Json(fn(&LedgerRow) -> Option<String>),
}

/// JSON text bound as `jsonb` (the `postgres` crate's own JSON support is a feature this build
/// does not enable): the binary format is a version byte, 1, then the text.
#[derive(Debug)]
pub struct Jsonb(pub String);

impl ToSql for Jsonb {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(&[1]);
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }

    to_sql_checked!();
}

impl<'a> FromSql<'a> for Jsonb {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        match raw.split_first() {
            Some((1, text)) => Ok(Jsonb(std::str::from_utf8(text)?.to_string())),
            _ => Err("unsupported jsonb format version".into()),
        }
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }
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
    ("decision", Extract::Text(|r| Some(&r.decision))),
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
        Extract::Text(|r| r.queue_outcome.as_deref()),
    ),
    ("error", Extract::Text(|r| r.error.as_deref())),
    (
        "inputs",
        Extract::Json(|r| r.inputs.and_then(|i| serde_json::to_string(&i).ok())),
    ),
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
    Json(Vec<Option<Jsonb>>),
}

impl<'a> Column<'a> {
    fn build(extract: Extract, rows: &'a [LedgerRow]) -> Self {
        match extract {
            Extract::Text(f) => Column::Text(rows.iter().map(f).collect()),
            Extract::Int8(f) => Column::Int8(rows.iter().map(f).collect()),
            Extract::Int4(f) => Column::Int4(rows.iter().map(f).collect()),
            Extract::Float8(f) => Column::Float8(rows.iter().map(f).collect()),
            Extract::Bool(f) => Column::Bool(rows.iter().map(f).collect()),
            Extract::Json(f) => Column::Json(rows.iter().map(|r| f(r).map(Jsonb)).collect()),
        }
    }

    fn param(&self) -> &(dyn ToSql + Sync) {
        match self {
            Column::Text(v) => v,
            Column::Int8(v) => v,
            Column::Int4(v) => v,
            Column::Float8(v) => v,
            Column::Bool(v) => v,
            Column::Json(v) => v,
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
        Extract::Json(_) => "jsonb",
    }
}

/// The batch INSERT into `decisions`.
pub fn insert_decisions_sql() -> String {
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
    pub fn build(rows: &'a [LedgerRow]) -> Self {
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
            queue_outcome: queue.map(|q| q.0.to_string()),
            queue_wait_ms: queue.and_then(|q| q.1),
            ..Default::default()
        }
    }

    #[test]
    fn sql_and_parameters_come_from_one_table() {
        let sql = insert_decisions_sql();
        let n = DECISION_COLUMNS.len();
        assert_eq!(
            n, 34,
            "one column per DecisionRecord field, signals flattened, plus completed_at_ms"
        );
        assert!(sql.contains(&format!("${n}::jsonb[]")));
        assert!(!sql.contains(&format!("${}::", n + 1)));
        let migrations = super::super::migrate::MIGRATIONS;
        for (name, _) in DECISION_COLUMNS {
            assert!(
                migrations
                    .iter()
                    .any(|m| m.2.contains(&format!("    {name} "))
                        || m.2.contains(&format!("ADD COLUMN {name} "))),
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
}
