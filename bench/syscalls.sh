#!/usr/bin/env bash
# Syscalls, context switches and wakes per proxied request, counted by `perf stat` on the proxy
# process during one wrk run at 16 connections (CONNS) through bare Pingora or Sluice in front of the
# static nginx backend (bench/lib/static_backend.sh). Counts, unlike req/s, do not move with
# what else the 2-core machine runs: this is how a change to the request path's waits (timers,
# channels, locks) is checked. `write` on a worker is almost always tokio waking the other
# worker through its eventfd; `futex` is a worker parking or a contended lock.
#   bench/syscalls.sh [seconds] [configs: bare sluice ledger both]
# Env: BIN (default target/release/sluice), CONNS (wrk's connections, default 16). Needs perf with the syscalls tracepoints (root).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=${1:-6}
CONFIGS=${2:-bare sluice}
CONNS=${CONNS:-16}
command -v perf >/dev/null || { echo "needs perf" >&2; exit 1; }
. bench/lib/static_backend.sh
events=task-clock,context-switches,raw_syscalls:sys_enter
for s in write futex epoll_wait sendto recvfrom; do events+=",syscalls:sys_enter_$s"; done
for cfg in $CONFIGS; do
  port=$(free_port)
  proxy_for "$cfg" "$port"
  env -u RUST_LOG "${cmd[@]}" >/dev/null 2>"$dir/$cfg.log" &
  spid=$!
  wait_ready "$port" "$ready"; sleep 1
  perf stat -e "$events" -p "$spid" -o "$dir/perf.$cfg" &
  ppid=$!
  out=$(wrk -t2 -c"$CONNS" -d"${SECS}s" -s bench/chat.lua "http://127.0.0.1:$port/v1/chat/completions")
  kill -INT $ppid; wait $ppid || true
  n=$(awk '/requests in/ {print $1}' <<<"$out")
  echo "$cfg: $n requests, $(awk '/Requests\/sec/ {print $2}' <<<"$out") req/s; per request:"
  awk -v n="$n" '/^ +[0-9]/ && $2 != "msec" && $2 != "seconds" {gsub(",", "", $1); sub(/^(raw_)?syscalls:sys_enter_?/, "", $2);
    printf "  %-18s %8.3f\n", ($2 == "" ? "all syscalls" : $2), $1 / n}
    /^ +[0-9]/ && $2 == "msec" {gsub(",", "", $1); printf "  %-18s %8.3f\n", "CPU (µs)", $1 * 1000 / n}' "$dir/perf.$cfg"
  kill -INT $spid; wait $spid 2>/dev/null || true; spid=""
done
