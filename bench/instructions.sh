#!/usr/bin/env bash
# Instructions per proxied request, counted by valgrind's callgrind: repeatable whatever else
# the machine runs (unlike req/s on a shared 2-core machine), so it is how request-path changes
# are compared. Bare Pingora (`sluice-bench bare-proxy`) and Sluice alone, with the ledger, and
# with the ledger and Redis admission (PostgreSQL and Redis must run locally), each under wrk at
# CONNS connections (default 16) for SECS seconds; counters are zeroed once the proxy is ready, so start-up is
# not counted. Background work (the metrics poller, the ledger writer) is, as it runs per request
# or per second. Prints instructions and heap allocations (calls into mimalloc) per request;
# callgrind files stay in $OUT for `callgrind_annotate`. VALGRIND_EXTRA adds callgrind options,
# e.g. "--separate-callers5=mi_malloc" to see who allocates.
#   bench/instructions.sh [path/to/sluice] [seconds] [configs: bare sluice ledger both]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=${2:-15}
CONFIGS=${3:-bare sluice ledger both}
OUT=${OUT:-/tmp/sluice-callgrind}
command -v valgrind >/dev/null || { echo "needs valgrind" >&2; exit 1; }
mkdir -p "$OUT"
. bench/lib/static_backend.sh
BENCH_NAME=sluice_instructions
for cfg in $CONFIGS; do
  port=$(free_port)
  proxy_for "$cfg" "$port"
  env -u RUST_LOG valgrind --tool=callgrind ${VALGRIND_EXTRA:-} --callgrind-out-file="$OUT/$cfg.out" "${cmd[@]}" \
    >/dev/null 2>"$OUT/$cfg.log" &
  spid=$!
  wait_ready "$port" "$ready"
  sleep 2
  callgrind_control -z $spid >/dev/null 2>&1
  out=$(wrk -t2 -c"${CONNS:-16}" -d${SECS}s -s bench/chat.lua "http://127.0.0.1:$port/v1/chat/completions")
  kill -INT $spid; wait $spid 2>/dev/null || true
  spid=""
  n=$(awk '/requests in/ {print $1}' <<<"$out")
  ir=$(callgrind_annotate "$OUT/$cfg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1; exit}')
  allocs=$(awk -f bench/lib/allocations.awk "$OUT/$cfg.out")
  printf '%-7s %6d requests  %8d instructions  %6.1f allocations per request\n' "$cfg" "$n" $((ir / n)) \
    "$(awk -v a="$allocs" -v n="$n" 'BEGIN {print a / n}')"
done
