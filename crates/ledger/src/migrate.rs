//! The ledger's schema as versioned migrations: SQL files embedded in the binary, applied in
//! order inside one transaction and recorded in `ledger_migrations`.
//!
//! Replicas start together, so the run holds a transaction-scoped advisory lock keyed on the
//! schema: the second replica waits, then finds every version recorded and applies nothing. A
//! migration is never re-run and never edited once shipped; a change is a new file.

use postgres::GenericClient;
use sha2::{Digest, Sha256};

/// (version, name, SQL), in the order they apply.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "init", include_str!("migrations/0001_init.sql")),
    (
        2,
        "replay_inputs",
        include_str!("migrations/0002_replay_inputs.sql"),
    ),
    (
        3,
        "lighter_writes",
        include_str!("migrations/0003_lighter_writes.sql"),
    ),
    (
        4,
        "binary_inputs",
        include_str!("migrations/0004_binary_inputs.sql"),
    ),
    (
        5,
        "slo_dimensions",
        include_str!("migrations/0005_slo_dimensions.sql"),
    ),
];

/// The advisory-lock key of a schema: stable across processes and builds (not Rust's hasher).
pub fn lock_key(schema: &str) -> i64 {
    let digest = Sha256::digest(format!("sluice-ledger-migrations:{schema}").as_bytes());
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// Creates the schema if needed and applies the migrations it lacks; returns the versions this
/// call applied (empty when the schema was already current). `schema` must be a validated
/// identifier (config validation), since it is spliced into SQL.
pub fn run(client: &mut postgres::Client, schema: &str) -> Result<Vec<i32>, postgres::Error> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(schema)])?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         SET LOCAL search_path TO {schema};
         CREATE TABLE IF NOT EXISTS ledger_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))?;
    let applied = applied_versions(&mut tx)?;
    let mut ran = Vec::new();
    for &(version, name, sql) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        if ran.is_empty() {
            // The writer's connections stop a statement after 15 s; rebuilding an index of a
            // large existing table may take longer, and must not fail (and retry) forever.
            tx.batch_execute("SET LOCAL statement_timeout = 0")?;
        }
        tx.batch_execute(sql)?;
        tx.execute(
            "INSERT INTO ledger_migrations (version, name) VALUES ($1, $2)",
            &[&version, &name],
        )?;
        ran.push(version);
    }
    tx.commit()?;
    Ok(ran)
}

fn applied_versions(client: &mut impl GenericClient) -> Result<Vec<i32>, postgres::Error> {
    client
        .query(
            "SELECT version FROM ledger_migrations ORDER BY version",
            &[],
        )?
        .iter()
        .map(|r| r.try_get(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_ascend_without_gaps_and_keys_differ_per_schema() {
        for (i, (v, name, sql)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*v as usize, i + 1);
            assert!(!name.is_empty() && !sql.trim().is_empty());
        }
        assert_eq!(lock_key("public"), lock_key("public"));
        assert_ne!(lock_key("public"), lock_key("sluice_t_1"));
    }
}
