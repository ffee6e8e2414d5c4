#!/usr/bin/env bash
# Issue 13 item 4: which Pingora server settings change Sluice's throughput on this machine.
# Runs Sluice (no ledger, no Redis: its own path only) in front of a static nginx backend with
# each combination of `server.threads`, `server.work_stealing` and
# `server.upstream_keepalive_pool_size`, and wrk at 16 and 64 connections with bench/chat.lua;
# prints req/s and p99 per combination. Everything else is Sluice's shipped default.
#   bench/pingora_settings.sh [path/to/sluice] [seconds per run]
#   THREADS="1 2 4" STEALING="true false" POOL="128" override the grid.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=${2:-5}
. bench/lib/static_backend.sh

printf '| threads | work_stealing | keepalive pool | c | req/s | p99 |\n|---|---|---|---|---|---|\n'
for t in ${THREADS:-1 2 4}; do
  for ws in ${STEALING:-true false}; do
    for pool in ${POOL:-128}; do
      port=$(free_port)
      SLUICE_THREADS=$t SERVER_EXTRA="work_stealing: $ws, upstream_keepalive_pool_size: $pool, " sluice_conf "$port"
      env -u RUST_LOG "$BIN" serve --config "$dir/sluice.yaml" >/dev/null 2>"$dir/sluice.log" &
      spid=$!
      wait_ready "$port" /readyz
      for c in 16 64; do
        out=$(wrk -t2 -c$c -d${SECS}s --latency -s bench/chat.lua "http://127.0.0.1:$port/v1/chat/completions")
        rps=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
        p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
        printf '| %s | %s | %s | %s | %.0f | %s |\n' "$t" "$ws" "$pool" "$c" "$rps" "$p99"
      done
      kill $spid; wait $spid 2>/dev/null || true
      spid=""
    done
  done
done
