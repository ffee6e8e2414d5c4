#!/usr/bin/env bash
# Req/s, p50 and p99 of proxy variants run in alternation, each a fresh process in front of the
# static nginx backend (bench/lib/static_backend.sh) with one wrk run after a 2 s warm-up. A
# ledger knob's effect on the tail is smaller than this machine's drift between two overhead
# runs; alternating the variants round by round puts the drift on all of them alike.
#   bench/latency_ab.sh SECS CONNECTIONS ROUNDS VARIANT...
# VARIANT: CONFIG (bare | sluice | ledger | both) or CONFIG:LEDGER_KEYS, the keys added to the
# ledger's map, e.g. "ledger:flush_interval_ms: 20, ". Env: BIN (default target/release/sluice).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=$1; C=$2; ROUNDS=$3; shift 3
BENCH_NAME=sluice_latency_ab
. bench/lib/static_backend.sh
url_of() { echo "http://127.0.0.1:$1/v1/chat/completions"; }
printf '| round | variant | req/s | p50 | p99 |\n|---|---|---|---|---|\n'
for round in $(seq 1 "$ROUNDS"); do
  for variant in "$@"; do
    cfg=${variant%%:*}
    LEDGER_EXTRA=""
    [ "$cfg" != "$variant" ] && LEDGER_EXTRA=${variant#*:}
    port=$(free_port)
    proxy_for "$cfg" "$port"
    env -u RUST_LOG "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
    spid=$!
    wait_ready "$port" "$ready"
    wrk -t2 -c"$C" -d2s -s bench/chat.lua "$(url_of "$port")" >/dev/null
    wrk -t2 -c"$C" -d"${SECS}s" --latency -s bench/chat.lua "$(url_of "$port")" >"$dir/wrk"
    kill "$spid"; wait "$spid" 2>/dev/null || true; spid=""
    printf '| %s | %s | %s | %s | %s |\n' "$round" "$variant" \
      "$(awk '/Requests\/sec/ {printf "%d", $2}' "$dir/wrk")" \
      "$(awk '$1 == "50%" {print $2}' "$dir/wrk")" "$(awk '$1 == "99%" {print $2}' "$dir/wrk")"
  done
done
