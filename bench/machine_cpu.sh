#!/usr/bin/env bash
# CPU per request of the whole machine and of each process, for one wrk run per config through
# bare Pingora or Sluice in front of the static nginx backend (bench/lib/static_backend.sh).
# Requests/s on a shared 2-core machine hide where the time goes: this shows the proxy's own
# CPU, PostgreSQL's, and the kernel's writeback threads (a request log or a ledger on disk),
# each in µs per request, from /proc (wrk has exited when the second snapshot is taken, so it
# is counted only in the machine's total).
#   bench/machine_cpu.sh SECS CONNECTIONS CONFIG...     CONFIG: bare | sluice | ledger | both
# Env: EXTRA_YAML (one more line of Sluice config, e.g. "decisions: {log_requests: all}"),
# RUSTLOG (RUST_LOG for Sluice; unset: the shipped level), BIN (default target/release/sluice),
# LEDGER_EXTRA (more keys of the ledger map, e.g. "batch_rows: 500, "). Also prints the
# machine's idle share over the run (a configuration can lose requests to idle cores, not CPU)
# and its steal share (CPU the virtual machine's host took: it moves req/s as much as a change),
# and the proxy's CPU per thread name (its workers, the log writer, the ledger writer).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=$1; C=$2; shift 2
. bench/lib/static_backend.sh
tk=$(getconf CLK_TCK)
BENCH_NAME=sluice_machine_cpu
extra=()
[ -n "${EXTRA_YAML:-}" ] && extra+=("$EXTRA_YAML")
# Ticks of user + system time per command name, summed over its processes.
snap() {
  for f in /proc/[0-9]*/stat; do cat "$f" 2>/dev/null || true; echo; done |
    awk 'NF>15 {c=$2; sub(/\(/,"",c); sub(/\).*/,"",c); t[c]+=$14+$15} END {for (k in t) print k, t[k]}' | sort
}
# Nanoseconds on CPU per thread name of one process (threads of one name summed: Pingora's
# workers share one), from schedstat: a thread's own utime/stime ticks in task/*/stat came to
# ~60 % of the process's total here, while schedstat's runtimes add up to it.
threads() {
  for t in /proc/"$1"/task/*; do
    printf '%s\t%s\n' "$(cat "$t/comm" 2>/dev/null || echo gone)" "$(awk '{print $1}' "$t/schedstat" 2>/dev/null || echo 0)"
  done | awk -F'\t' '{gsub(/ /, "_", $1); t[$1] += $2} END {for (k in t) printf "%s %d\n", k, t[k]}' | sort
}
machine() { awk '/^cpu / {print $2+$3+$4+$6+$7+$8}' /proc/stat; }
idle() { awk '/^cpu / {print $5}' /proc/stat; }
# Ticks the virtual machine's host took from this machine's cores (steal).
steal() { awk '/^cpu / {print $9}' /proc/stat; }
for cfg in "$@"; do
  port=$(free_port)
  proxy_for "$cfg" "$port" "${extra[@]}"
  if [ -n "${RUSTLOG:-}" ]; then
    env RUST_LOG="$RUSTLOG" "${cmd[@]}" >"$dir/$cfg.out" 2>"$dir/$cfg.log" &
  else
    env -u RUST_LOG "${cmd[@]}" >"$dir/$cfg.out" 2>"$dir/$cfg.log" &
  fi
  spid=$!
  wait_ready "$port" "$ready"; sleep 1.5
  i0=$(idle); t0=$(steal); snap >"$dir/s0"; threads $spid >"$dir/t0"; p0=$(awk '{print $14+$15}' /proc/$spid/stat); m0=$(machine)
  out=$(wrk -t2 -c"$C" -d"${SECS}s" -s bench/chat.lua "http://127.0.0.1:$port/v1/chat/completions")
  i1=$(idle); t1=$(steal); snap >"$dir/s1"; threads $spid >"$dir/t1"; p1=$(awk '{print $14+$15}' /proc/$spid/stat); m1=$(machine)
  kill -INT $spid; wait $spid 2>/dev/null || true; spid=""
  n=$(awk '/requests in/ {print $1}' <<<"$out"); rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  join -a1 -a2 -e 0 -o 0,1.2,2.2 "$dir/s0" "$dir/s1" |
    awk -v n="$n" -v tk="$tk" '{d = $3 - $2; if (d / tk * 1e6 / n >= 0.5) printf "   %-34s %6.1f µs/req\n", $1, d / tk * 1e6 / n}'
  join -a1 -a2 -e 0 -o 0,1.2,2.2 "$dir/t0" "$dir/t1" |
    awk -v n="$n" '{d = ($3 - $2) / 1000 / n; if (d >= 0.5) printf "     proxy thread %-21s %6.1f µs/req\n", $1, d}'
  awk -v n="$n" -v r="$rps" -v p=$((p1 - p0)) -v m=$((m1 - m0)) -v tk="$tk" -v c="$cfg" \
    -v i=$((i1 - i0)) -v st=$((t1 - t0)) -v s="$SECS" -v cores="$(nproc)" \
    'BEGIN {printf "%-7s %8.0f req/s   proxy %6.1f µs/req   machine %6.1f µs/req   idle %.0f %%   steal %.0f %%\n", c, r, p / tk * 1e6 / n, m / tk * 1e6 / n, i / tk / s / cores * 100, st / tk / s / cores * 100}'
done
