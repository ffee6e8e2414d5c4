#!/usr/bin/env bash
# What PostgreSQL spends on each ledger row, by part of the schema: the rows the overhead bench
# wrote (`sluice_bench.decisions`, so run `sluice-bench overhead` first) copied out once in
# binary COPY format, then COPYed back into a scratch table (schema `sluice_ledger_rows`, dropped
# at the end) with only the heap, with the primary key, with the tenant index, and with every
# index the migrations create; then, as alternatives to the shipped schema, without the SLA
# window's index on completed_at_ms, with it as a BRIN index, and with the indexed text columns in
# the "C" collation (the database's may be C.UTF-8, which compares through strcoll); and, as the
# one layout that drops the per-row index work altogether, the same rows stored a batch to a row
# (BATCH rows, each column an array, as a writer's batch would be), with PostgreSQL's compression
# of the arrays and without it. Prints wall time per row (per decision, for the batch layout) of
# each COPY after a CHECKPOINT, ROUNDS times; the psql client's read of the file is in every
# figure alike, so compare the differences.
#   bench/ledger_rows.sh [rows, default 100000] [rounds, default 2]
# Env: PGURL (default postgres://postgres@127.0.0.1:5432/test), BATCH (default 2400: a 100 ms
# batch at ~24k requests/s).
set -euo pipefail
ROWS=${1:-100000}
ROUNDS=${2:-2}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432/test}
BATCH=${BATCH:-2400}
S=sluice_ledger_rows
B=${S}_batches
DATA=$(mktemp /tmp/sluice-ledger-rows.XXXXXX)
BATCHES=$(mktemp /tmp/sluice-ledger-batches.XXXXXX)
trap 'rm -f "$DATA" "$BATCHES"; psql -q "$PGURL" -c "DROP SCHEMA IF EXISTS $S CASCADE; DROP SCHEMA IF EXISTS $B CASCADE" >/dev/null 2>&1 || true' EXIT
export PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning"
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
# label, the SQL creating the empty table $S.d, the binary COPY file loaded into it
timed() {
  P -c "DROP SCHEMA IF EXISTS $S CASCADE" >/dev/null 2>&1
  P -c "CREATE SCHEMA $S; $2" >/dev/null
  P -c "CHECKPOINT" >/dev/null
  local t0 t1
  t0=$(date +%s%N)
  P -c "\copy $S.d FROM '$3' WITH (FORMAT binary)"
  t1=$(date +%s%N)
  printf '  %-44s %6.1f µs a row\n' "$1" "$(awk -v d=$((t1 - t0)) -v n="$ROWS" 'BEGIN {print d / n / 1000}')"
}
one() { # label, DDL applied to the empty copy of the table
  timed "$1" "CREATE TABLE $S.d (LIKE sluice_bench.decisions INCLUDING DEFAULTS); $2" "$DATA"
}
# The batch layout's input: the same rows, BATCH to a row in arrival order, each column an array
# (in a schema of its own, which one() does not drop).
COLS=$(P -Atc "SELECT string_agg(format('array_agg(%I ORDER BY received_at_ms, request_id) AS %I',
  attname, attname), ', ' ORDER BY attnum) FROM pg_attribute
  WHERE attrelid = 'sluice_bench.decisions'::regclass AND attnum > 0 AND NOT attisdropped")
P -c "DROP SCHEMA IF EXISTS $B CASCADE; CREATE SCHEMA $B;
  CREATE TABLE $B.src AS SELECT * FROM sluice_bench.decisions ORDER BY received_at_ms DESC LIMIT $ROWS;
  CREATE TABLE $B.numbered AS SELECT (row_number() OVER (ORDER BY received_at_ms, request_id) - 1) / $BATCH
    AS batch, * FROM $B.src;
  CREATE TABLE $B.batches AS SELECT batch, min(received_at_ms) AS first_ms, $COLS
    FROM $B.numbered GROUP BY batch" >/dev/null
P -c "\copy (SELECT * FROM $B.batches ORDER BY batch) TO '$BATCHES' WITH (FORMAT binary)"
UNCOMPRESSED=$(P -Atc "SELECT string_agg(format('ALTER TABLE $S.d ALTER COLUMN %I SET STORAGE EXTERNAL;',
  attname), ' ') FROM pg_attribute WHERE attrelid = '$B.batches'::regclass AND attnum > 2")
P -c "DROP SCHEMA $B CASCADE" >/dev/null
ARRAYS=$(P -Atc "SELECT string_agg(format('%I %s[]', attname, format_type(atttypid, atttypmod)), ', '
  ORDER BY attnum) FROM pg_attribute
  WHERE attrelid = 'sluice_bench.decisions'::regclass AND attnum > 0 AND NOT attisdropped")
batched() { # label, DDL applied to the empty batch table
  timed "$1" "CREATE TABLE $S.d (batch bigint PRIMARY KEY, first_ms bigint NOT NULL, $ARRAYS);
    CREATE INDEX ON $S.d (first_ms); $2" "$BATCHES"
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
  batched "a batch a row, arrays compressed" ""
  batched "a batch a row, arrays uncompressed" "$UNCOMPRESSED"
done
