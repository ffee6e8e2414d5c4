#!/usr/bin/env bash
# What PostgreSQL spends on each ledger row, by part of the schema: the rows the overhead bench
# wrote (`sluice_bench.decisions`, so run `sluice-bench overhead` first) copied out once in
# binary COPY format, then COPYed back into a scratch table (schema `sluice_ledger_rows`, dropped
# at the end) with only the heap, with the primary key, with the tenant index, and with every
# index the migrations create; then, as alternatives to the shipped schema, without the SLA
# window's index on completed_at_ms, with it as a BRIN index, and with the indexed text columns in
# the "C" collation (the database's may be C.UTF-8, which compares through strcoll). Prints wall
# time per row of each COPY after a CHECKPOINT, ROUNDS times; the psql client's read of the file
# is in every figure alike, so compare the differences.
#   bench/ledger_rows.sh [rows, default 100000] [rounds, default 2]
# Env: PGURL (default postgres://postgres@127.0.0.1:5432/test).
set -euo pipefail
ROWS=${1:-100000}
ROUNDS=${2:-2}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432/test}
S=sluice_ledger_rows
DATA=$(mktemp /tmp/sluice-ledger-rows.XXXXXX)
trap 'rm -f "$DATA"; psql -q "$PGURL" -c "DROP SCHEMA IF EXISTS $S CASCADE" >/dev/null 2>&1 || true' EXIT
P() { psql -q -v ON_ERROR_STOP=1 "$PGURL" "$@"; }
have=$(P -Atc "SELECT count(*) FROM sluice_bench.decisions") || {
  echo "needs sluice_bench.decisions: run target/release/sluice-bench overhead first" >&2; exit 1; }
[ "$have" -ge "$ROWS" ] || { echo "sluice_bench.decisions has $have rows, fewer than $ROWS" >&2; exit 1; }
P -c "\copy (SELECT * FROM sluice_bench.decisions ORDER BY received_at_ms DESC LIMIT $ROWS) TO '$DATA' WITH (FORMAT binary)"
echo "$ROWS rows, $(($(stat -c %s "$DATA") / ROWS)) bytes each in binary COPY"
PKEY="ALTER TABLE $S.d ADD PRIMARY KEY (received_at_ms, request_id);"
TENANT="CREATE INDEX ON $S.d (tenant, received_at_ms);"
COMPLETED="CREATE INDEX ON $S.d (completed_at_ms) WHERE sla_violated IS NOT NULL;"
DECISION="CREATE INDEX ON $S.d (decision, received_at_ms) WHERE decision <> 'pass';"
BRIN="CREATE INDEX ON $S.d USING brin (completed_at_ms) WITH (autosummarize = on);"
C_KEYS="ALTER TABLE $S.d ALTER COLUMN request_id TYPE text COLLATE \"C\",
          ALTER COLUMN tenant TYPE text COLLATE \"C\", ALTER COLUMN decision TYPE text COLLATE \"C\";"
one() { # label, DDL applied to the empty copy of the table
  P -c "DROP SCHEMA IF EXISTS $S CASCADE" >/dev/null 2>&1
  P -c "CREATE SCHEMA $S; CREATE TABLE $S.d (LIKE sluice_bench.decisions INCLUDING DEFAULTS); $2" >/dev/null
  P -c "CHECKPOINT" >/dev/null
  local t0 t1
  t0=$(date +%s%N)
  P -c "\copy $S.d FROM '$DATA' WITH (FORMAT binary)"
  t1=$(date +%s%N)
  printf '  %-44s %6.1f µs a row\n' "$1" "$(awk -v d=$((t1 - t0)) -v n="$ROWS" 'BEGIN {print d / n / 1000}')"
}
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  one "heap only" ""
  one "+ primary key" "$PKEY"
  one "+ primary key, tenant index" "$PKEY $TENANT"
  one "+ every index (as shipped)" "$PKEY $TENANT $COMPLETED $DECISION"
  one "  shipped, no index on completed_at_ms" "$PKEY $TENANT $DECISION"
  one "  shipped, completed_at_ms as BRIN" "$PKEY $TENANT $BRIN $DECISION"
  one "  shipped, text keys in the C collation" "$C_KEYS $PKEY $TENANT $COMPLETED $DECISION"
done
