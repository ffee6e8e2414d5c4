#!/usr/bin/env bash
# CPU cost of the PostgreSQL decision ledger per request, measured in CPU time rather than in
# throughput, so it holds on a shared machine whose other load makes req/s swing by ±20 %.
#
# For each mode (ledger off, ledger on) it starts a static nginx backend and a release
# `sluice serve` (2 threads, the overhead bench's config), drives it with wrk for SECONDS at
# CONNECTIONS, waits until the writer has committed every row, and reads the CPU seconds
# (utime + stime from /proc/<pid>/stat) consumed over that window by
#   * the sluice process (request threads, writer, SLA and retention services; "(ledger)" is the
#     part of it spent on the ledger's own threads: the writer and its encoding), and
#   * the PostgreSQL backends serving the ledger (found by their application_name),
# then divides by the number of requests Sluice decided (sluice_decisions_total). It also checks
# that the ledger holds exactly one row per decided request (nothing lost, nothing doubled).
# Compare the ledger's own columns ("(ledger)", pg-write, pg-read): they are per-row work. The
# request path's CPU per request ("sluice", "wrk+ngx") falls when the machine saturates (more
# events per wakeup), so a ledger that loads the machine can make them look cheaper.
# PostgreSQL's shared background processes (walwriter, checkpointer) are reported apart: other
# users of the server make them noisy. "wrk+ngx" is the load generator's and the backend's CPU
# per request: with it, the throughput ratio a CPU-bound machine would show is about
# (total_off + wrk+ngx) / (total_on + wrk+ngx).
#
#   bench/ledger_cpu.sh [path/to/sluice] [seconds] [connections] [modes] [extra ledger yaml]
#   e.g. bench/ledger_cpu.sh target/release/sluice 10 16 "off on"
#        bench/ledger_cpu.sh target/release/sluice 10 16 on "synchronous_commit: true"
# PERF_DIR=/tmp/prof also records `perf record -g` of sluice and of the ledger's PostgreSQL
# backends over the measured window (perf-<mode>-sluice.data, perf-<mode>-pg.data; the CPU
# figures then include perf's own overhead).
# Needs wrk, nginx, psql, curl, jq, and PostgreSQL at postgres@127.0.0.1:5432/test. Uses its own
# schema sluice_ledger_cpu, fresh for each "on" run and dropped at the end; the server is never
# restarted.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=${2:-10}
CONNS=${3:-16}
MODES=${4:-off on}
EXTRA=${5:-}
APP=sluice-ledger-cpu
SCHEMA=sluice_ledger_cpu
PSQL=(psql -X -q -h 127.0.0.1 -U postgres -d test -At -v ON_ERROR_STOP=1)
BIN=$(readlink -f "$BIN")
for tool in wrk nginx psql curl jq; do
    command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
[ -x "$BIN" ] || { echo "no sluice binary at $BIN (cargo build --release --bin sluice)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/sluice-ledger-cpu.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
    "${PSQL[@]}" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# CPU ticks (utime + stime) of a process; 0 when it is gone. Field 2 (comm) has no spaces here.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# CPU ticks of the sluice threads named "BG ledger …" (the writer, its blocking jobs, the SLA
# window): the ledger's own share of sluice's CPU, far less noisy than the difference of two runs.
# A blocking thread that exits during the run (idle for 10 s: a writer stuck behind PostgreSQL)
# takes its ticks with it, so this can undercount, even go negative.
ledger_thread_ticks() {
    local f t=0 rest
    for f in /proc/"$1"/task/*/stat; do
        rest=$(cat "$f" 2>/dev/null) || continue
        case "$rest" in *"(BG ledger"*) ;; *) continue ;; esac
        rest=${rest##*) }
        t=$((t + $(awk '{print $12 + $13}' <<<"$rest")))
    done
    echo "$t"
}
HZ=$(getconf CLK_TCK)

# "pid ticks role" for each PostgreSQL backend of the ledger; role is "read" for the read pool's
# connections (their last statement is a SELECT: /decisions/recent, the SLA window), else "write".
pg_backends() {
    local pid role
    while IFS='|' read -r pid role; do
        [ -n "$pid" ] && echo "$pid $(ticks "$pid") $role"
    done < <("${PSQL[@]}" -c "SELECT pid, CASE WHEN query ILIKE 'select%' THEN 'read' ELSE 'write' END
                               FROM pg_stat_activity WHERE application_name = '$APP'")
}
# PostgreSQL's shared background processes (walwriter, checkpointer, background writer).
pg_aux_ticks() {
    local t=0 p
    for p in $(pgrep -f 'postgres: .*(walwriter|checkpointer|background writer)' || true); do
        t=$((t + $(ticks "$p")))
    done
    echo "$t"
}
# "write read": ticks the backends gained since a pg_backends snapshot (new ones from zero).
pg_delta() {
    local before=$1 write=0 read=0 pid now role was
    while read -r pid now role; do
        [ -n "$pid" ] || continue
        was=$(awk -v p="$pid" '$1 == p {print $2}' <<<"$before")
        if [ "$role" = read ]; then read=$((read + now - ${was:-0})); else write=$((write + now - ${was:-0})); fi
    done < <(pg_backends)
    echo "$write $read"
}

decided() {
    curl -fsS "http://$LISTEN/metrics" | awk '/^sluice_decisions_total/ {s += $NF} END {printf "%d\n", s}'
}

# The static backend: a one-token chat completion, vLLM's /health and /metrics.
BACKEND_PORT=$(free_port)
mkdir -p "$WORK/nginx"
COMPLETION='{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"llama-3-70b","choices":[{"index":0,"message":{"role":"assistant","content":"tok "},"finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
METRICS='vllm:kv_cache_usage_perc{model_name=\"llama-3-70b\",engine=\"0\"} 0.1\nvllm:num_requests_waiting{model_name=\"llama-3-70b\",engine=\"0\"} 0\n'
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body; proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi; uwsgi_temp_path $WORK/nginx/uwsgi; scgi_temp_path $WORK/nginx/scgi;
  server {
    listen 127.0.0.1:$BACKEND_PORT;
    keepalive_requests 1000000;
    location = /health { return 200; }
    location = /metrics { default_type text/plain; return 200 '$METRICS'; }
    location / { default_type application/json; return 200 '$COMPLETION'; }
  }
}
EOF
nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" >"$WORK/nginx/stderr.log" 2>&1 &
NGINX=$!
PIDS+=("$NGINX")
for _ in $(seq 50); do curl -fsS "http://127.0.0.1:$BACKEND_PORT/health" >/dev/null 2>&1 && break; sleep 0.1; done

cat >"$WORK/chat.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"model":"llama-3-70b","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Tenant-ID"] = "support-bot"
EOF

printf '%-4s %5s %9s %8s | %9s %9s %9s %9s %9s | %8s %8s %s\n' mode conns requests "req/s" \
    sluice "(ledger)" pg-write pg-read total "pg aux" "wrk+ngx" "rows (CPU µs per request)"
for mode in $MODES; do
    LISTEN=127.0.0.1:$(free_port)
    dir="$WORK/$mode"
    mkdir -p "$dir"
    {
        echo "listen: [\"$LISTEN\"]"
        echo "server: {threads: 2, grace_period_seconds: 0, graceful_shutdown_timeout_seconds: 1,"
        echo "         upgrade_sock: $dir/upgrade.sock, pid_file: $dir/sluice.pid}"
        echo "tenants: {support-bot: Guaranteed, coding-assistant: Standard, batch-analytics: Best-Effort}"
        echo "pools: {on-demand: {backends: [\"127.0.0.1:$BACKEND_PORT\"]}, spot: {backends: [\"127.0.0.1:$BACKEND_PORT\"]}}"
        echo "tiers: {Guaranteed: {inflight_capacity: 10000}}"
        if [ "$mode" = on ]; then
            echo "database_url: \"postgres://postgres@127.0.0.1:5432/test?application_name=$APP\""
            echo "ledger:"
            echo "  schema: $SCHEMA"
            echo "  spool_dir: $dir/spool"
            [ -z "$EXTRA" ] || echo "  $EXTRA"
        fi
    } >"$dir/sluice.yaml"
    if [ "$mode" = on ]; then
        "${PSQL[@]}" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null
    fi
    env -u RUST_LOG "$BIN" serve --config "$dir/sluice.yaml" >"$dir/sluice.log" 2>&1 &
    SPID=$!
    PIDS+=("$SPID")
    ready=
    for _ in $(seq 300); do
        if st=$(curl -fsS "http://$LISTEN/status" 2>/dev/null); then
            if [ "$mode" = off ] || [ "$(jq -r '.dependencies.ledger' <<<"$st")" = true ]; then
                ready=1
                break
            fi
        fi
        sleep 0.1
    done
    [ -n "$ready" ] || { echo "sluice ($mode) never became ready; see $dir/sluice.log" >&2; tail "$dir/sluice.log" >&2; exit 1; }
    # Warm up (connections, pools, the table's first pages), then let the writer settle.
    wrk -t2 -c"$CONNS" -d2s -s "$WORK/chat.lua" "http://$LISTEN/v1/chat/completions" >/dev/null
    settle() {
        [ "$mode" = on ] || { sleep 0.5; return; }
        local want rows
        want=$(decided)
        for _ in $(seq 600); do
            rows=$("${PSQL[@]}" -c "SELECT count(*) FROM $SCHEMA.decisions")
            [ "$rows" -ge "$want" ] && { echo "$rows"; return; }
            sleep 0.05
        done
        echo "$rows"
    }
    batches() { curl -fsS "http://$LISTEN/status" | jq '.ledger[0].batches_written // 0'; }
    rows0=$(settle)
    b0=$([ "$mode" = on ] && batches || echo 0)
    d0=$(decided)
    s0=$(ticks "$SPID")
    l0=$(ledger_thread_ticks "$SPID")
    pg0=$([ "$mode" = on ] && pg_backends || true)
    aux0=$(pg_aux_ticks)
    gen0=$(ticks "$(pgrep -P "$NGINX" | head -1)")
    PERFS=()
    if [ -n "${PERF_DIR:-}" ]; then
        mkdir -p "$PERF_DIR"
        perf record -q -g -o "$PERF_DIR/perf-$mode-sluice.data" -p "$SPID" >/dev/null 2>&1 &
        PERFS+=($!)
        pgpids=$(awk '{print $1}' <<<"$pg0" | paste -sd, -)
        if [ -n "$pgpids" ]; then
            perf record -q -g -o "$PERF_DIR/perf-$mode-pg.data" -p "$pgpids" >/dev/null 2>&1 &
            PERFS+=($!)
        fi
    fi
    # wrk's own CPU (bash's `time`: user and system seconds of the child).
    TIMEFORMAT='%U %S'
    { time wrk -t2 -c"$CONNS" -d"${SECS}s" -s "$WORK/chat.lua" "http://$LISTEN/v1/chat/completions" \
        >"$dir/wrk.txt" 2>/dev/null; } 2>"$dir/wrk.time"
    rows1=$(settle)
    b1=$([ "$mode" = on ] && batches || echo 0)
    d1=$(decided)
    s1=$(ticks "$SPID")
    l1=$(ledger_thread_ticks "$SPID")
    pgd=$([ "$mode" = on ] && pg_delta "$pg0" || echo 0 0)
    aux1=$(pg_aux_ticks)
    gen1=$(ticks "$(pgrep -P "$NGINX" | head -1)")
    for p in "${PERFS[@]}"; do kill -INT "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    n=$((d1 - d0))
    rps=$(awk '/Requests\/sec/ {printf "%.0f", $2}' "$dir/wrk.txt")
    rows="-"
    if [ "$mode" = on ]; then
        rows="$((rows1 - rows0)) rows"
        dup=$("${PSQL[@]}" -c "SELECT count(*) - count(DISTINCT (request_id, received_at_ms)) FROM $SCHEMA.decisions")
        [ "$((rows1 - rows0))" -eq "$n" ] && [ "$dup" -eq 0 ] && rows="$rows, none lost" ||
            rows="$rows for $n decided (LOST OR DOUBLED), $dup duplicates, ledger status: $(curl -fsS "http://$LISTEN/status" |
                jq -c '.ledger[0] | {buffered_rows, spooled_rows, dropped, rows_written, flush_errors, last_error}')"
        [ "$((b1 - b0))" -le 0 ] || rows="$rows, $(((rows1 - rows0) / (b1 - b0))) rows/batch"
    fi
    read -r pw pr <<<"$pgd"
    read -r wu ws <"$dir/wrk.time"
    awk -v m="$mode" -v c="$CONNS" -v n="$n" -v r="$rps" -v s=$((s1 - s0)) -v l=$((l1 - l0)) -v pw="$pw" -v pr="$pr" \
        -v a=$((aux1 - aux0)) -v g=$((gen1 - gen0)) -v wrk="$(awk -v u="$wu" -v s="$ws" 'BEGIN {print u + s}')" \
        -v hz="$HZ" -v rows="$rows" 'BEGIN {
        f = 1e6 / hz / n
        printf "%-4s %5d %9d %8d | %9.1f %9.1f %9.1f %9.1f %9.1f | %8.1f %8.1f %s\n", m, c, n, r, s * f, l * f, pw * f, pr * f, (s + pw + pr) * f, a * f, g * f + wrk * 1e6 / n, rows
    }'
    kill "$SPID"
    wait "$SPID" 2>/dev/null || true
done
