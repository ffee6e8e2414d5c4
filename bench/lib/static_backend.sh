# Sourced by the instruction and settings scripts: a static nginx backend that answers like vLLM
# in microseconds (a one-token completion, /health, /metrics), on a free port, in a temporary
# directory removed on exit. Sets $dir, $backend (its port); free_port and cleanup helpers.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for tool in wrk nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
dir=$(mktemp -d /tmp/sluice-bench.XXXXXX)
backend=$(free_port)
mkdir -p "$dir/ng"
cat >"$dir/ng/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $dir/ng/nginx.pid;
error_log $dir/ng/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/ng/body; proxy_temp_path $dir/ng/proxy; fastcgi_temp_path $dir/ng/f;
  uwsgi_temp_path $dir/ng/u; scgi_temp_path $dir/ng/s;
  server {
    listen 127.0.0.1:$backend;
    keepalive_requests 1000000;
    location = /health { return 200; }
    location = /metrics { default_type text/plain; return 200 'vllm:kv_cache_usage_perc{model_name="llama-3-70b"} 0.1\nvllm:num_requests_waiting{model_name="llama-3-70b"} 0\n'; }
    location / { default_type application/json; return 200 '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"llama-3-70b","choices":[{"index":0,"message":{"role":"assistant","content":"tok "},"finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'; }
  }
}
EOF
nginx -p "$dir/ng" -c "$dir/ng/nginx.conf" -e "$dir/ng/error.log" &
ngpid=$!
spid=""
cleanup() { kill $ngpid 2>/dev/null; [ -n "$spid" ] && kill $spid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
sleep 0.5

# sluice_conf PORT [extra yaml lines...]: the overhead bench's Sluice config, on $dir/sluice.yaml.
sluice_conf() {
  local port=$1; shift
  cat >"$dir/sluice.yaml" <<EOF
listen: ["127.0.0.1:$port"]
server: {threads: ${SLUICE_THREADS:-2}, ${SERVER_EXTRA:-}grace_period_seconds: 0, graceful_shutdown_timeout_seconds: 1,
         upgrade_sock: $dir/upgrade.sock, pid_file: $dir/sluice.pid}
tenants: {support-bot: Guaranteed, coding-assistant: Standard, batch-analytics: Best-Effort}
pools: {on-demand: {backends: ["127.0.0.1:$backend"]}, spot: {backends: ["127.0.0.1:$backend"]}}
tiers: {Guaranteed: {inflight_capacity: 10000}}
EOF
  for line in "$@"; do printf '%s\n' "$line" >>"$dir/sluice.yaml"; done
}

# proxy_for CONFIG PORT [extra yaml lines...]: the proxy under test in $cmd (its command line)
# and $ready (its readiness path): bare (`sluice-bench bare-proxy`, next to $BIN), sluice, ledger
# (+ the PostgreSQL ledger) or both (+ the ledger and Redis admission); Sluice's config goes to
# $dir/sluice.yaml. BENCH_NAME names the ledger's schema and the Redis key prefix, so scripts
# do not share state; LEDGER_EXTRA adds keys to the ledger's map (e.g. "batch_rows: 500, ").
proxy_for() {
  local cfg=$1 port=$2; shift 2
  local name=${BENCH_NAME:-sluice_bench}
  local ledger=("database_url: postgres://postgres@127.0.0.1:5432/test"
                "ledger: {schema: $name, ${LEDGER_EXTRA:-}spool_dir: $dir/spool}")
  local redis=("redis_url: redis://127.0.0.1:6379" "coordination: {redis_prefix: ${name//_/-}}")
  case $cfg in
    bare) cmd=("$(dirname "$BIN")/sluice-bench" bare-proxy --listen "127.0.0.1:$port"
               --upstream "127.0.0.1:$backend" --threads="${SLUICE_THREADS:-2}"); ready=/health; return ;;
    sluice) sluice_conf "$port" "$@" ;;
    ledger) sluice_conf "$port" "${ledger[@]}" "$@" ;;
    both) sluice_conf "$port" "${ledger[@]}" "${redis[@]}" "$@" ;;
    *) echo "unknown config $cfg" >&2; exit 1 ;;
  esac
  cmd=("$BIN" serve --config "$dir/sluice.yaml"); ready=/readyz
}

# wait_ready PORT PATH
wait_ready() {
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null -m 1 "http://127.0.0.1:$1$2" && return 0
    sleep 0.1
  done
  echo "not ready on port $1" >&2; return 1
}
