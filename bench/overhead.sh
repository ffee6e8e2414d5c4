#!/usr/bin/env bash
# Proxy overhead at fixed concurrency: wrk straight to an instant vLLM simulator, then through
# Sluice (full policy pipeline, in-process admission), and Sluice's own overhead histogram.
#   bench/overhead.sh [path/to/sluice] [seconds per run]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/sluice}
SECS=${2:-10}
command -v wrk >/dev/null || { echo "wrk is required (apt-get install wrk)"; exit 1; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
OD=$(port); SP=$(port); PX=$(port)
sim_flags="--ttft-ms 0 --itl-ms 0 --prefill-us-per-token 0 --max-running 4096 --kv-tokens 100000000"
"$BIN" sim --listen 127.0.0.1:$OD $sim_flags >/dev/null 2>&1 &
"$BIN" sim --listen 127.0.0.1:$SP $sim_flags >/dev/null 2>&1 &
cat > "$work/sluice.yaml" <<YAML
listen: ["127.0.0.1:$PX"]
server: {grace_period_seconds: 0, upgrade_sock: $work/u.sock, pid_file: $work/p.pid}
tenants: {support-bot: Guaranteed, coding-assistant: Standard, batch-analytics: Best-Effort}
pools:
  on-demand: {backends: ["127.0.0.1:$OD"]}
  spot: {backends: ["127.0.0.1:$SP"]}
tiers:
  Guaranteed: {inflight_capacity: 10000}
YAML
RUST_LOG=warn "$BIN" serve --config "$work/sluice.yaml" >"$work/sluice.log" 2>&1 &
for _ in $(seq 1 100); do curl -sf "127.0.0.1:$PX/readyz" >/dev/null && break; sleep 0.1; done

echo "# machine: $(nproc) cores, $(uname -m); commit $(git rev-parse --short HEAD); ${SECS}s per run; wrk, 1 thread per 16 connections"
printf '| target | connections | req/s | p50 | p99 |\n|---|---|---|---|---|\n'
for c in 1 16 64; do
  t=$(( c < 2 ? 1 : 2 ))
  for target in direct sluice; do
    if [ $target = direct ]; then url="http://127.0.0.1:$OD/v1/chat/completions"; else url="http://127.0.0.1:$PX/v1/chat/completions"; fi
    out=$(wrk -t$t -c$c -d${SECS}s --latency -s bench/chat.lua "$url")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    p50=$(echo "$out" | awk '$1=="50%" {print $2}')
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $4}')
    printf '| %s | %s | %s | %s | %s |%s\n' "$target" "$c" "$rps" "$p50" "$p99" "${non2xx:+ non-2xx: $non2xx}"
  done
done
echo
echo "Sluice's own overhead (sluice_proxy_overhead_seconds: arrival → upstream chosen, queue wait excluded):"
curl -s "127.0.0.1:$PX/metrics" | python3 bench/histogram_quantiles.py sluice_proxy_overhead_seconds
