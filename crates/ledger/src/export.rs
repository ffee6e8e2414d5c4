//! Reading the ledger back for `sluice replay` and `sluice replay export`: decision rows over a
//! time range in arrival order, streamed through a cursor (a day of traffic is too much for one
//! result set), on a connection of its own — the proxy's read pool gives up after two seconds.
//! Read-only: a schema the replay-inputs migration has not reached yet reads as rows without
//! inputs.

use super::batch::decision_column_list;
use super::row::LedgerRow;
use postgres::NoTls;

/// Rows fetched per round trip.
const CHUNK: i32 = 2000;

fn identifier(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Calls `each` for every decision received in `[since_ms, until_ms)`, oldest first; returns
/// how many there were.
pub fn scan(
    url: &str,
    schema: &str,
    since_ms: u64,
    until_ms: u64,
    mut each: impl FnMut(LedgerRow),
) -> Result<u64, String> {
    if !identifier(schema) {
        return Err(format!("schema {schema:?} is not an identifier"));
    }
    let mut cfg: postgres::Config = url
        .parse()
        .map_err(|e| format!("--database-url is not a usable PostgreSQL URL: {e}"))?;
    let options = format!(
        "{} -c search_path={schema}",
        cfg.get_options().unwrap_or("")
    );
    cfg.options(options.trim());
    if cfg.get_application_name().is_none() {
        cfg.application_name("sluice-replay");
    }
    let mut client = cfg.connect(NoTls).map_err(|e| e.to_string())?;
    let has_inputs = !client
        .query(
            "SELECT 1 FROM information_schema.columns
             WHERE table_schema = $1 AND table_name = 'decisions' AND column_name = 'inputs'",
            &[&schema],
        )
        .map_err(|e| e.to_string())?
        .is_empty();
    let columns = decision_column_list();
    let columns = if has_inputs {
        columns
    } else {
        columns.replace("inputs", "NULL::bytea AS inputs")
    };
    let sql = format!(
        "SELECT {columns} FROM decisions WHERE received_at_ms >= $1 AND received_at_ms < $2
         ORDER BY received_at_ms, request_id"
    );
    let (since, until) = (
        i64::try_from(since_ms).unwrap_or(i64::MAX),
        i64::try_from(until_ms).unwrap_or(i64::MAX),
    );
    let mut tx = client.transaction().map_err(|e| e.to_string())?;
    let portal = tx
        .bind(sql.as_str(), &[&since, &until])
        .map_err(|e| e.to_string())?;
    let mut n = 0;
    loop {
        let rows = tx.query_portal(&portal, CHUNK).map_err(|e| e.to_string())?;
        if rows.is_empty() {
            break;
        }
        for r in &rows {
            each(super::db::row_of(r).map_err(|e| e.to_string())?);
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_identifiers_are_spliced_as_the_schema() {
        assert!(super::identifier("sluice_t_1"));
        assert!(!super::identifier("x; DROP TABLE decisions"));
        assert!(!super::identifier("1abc"));
        assert!(!super::identifier(""));
    }
}
