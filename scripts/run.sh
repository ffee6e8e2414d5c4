#!/usr/bin/env bash
# The README's run command: builds Sluice (installing CMake first when the machine lacks it) and
# runs it. With no arguments it runs `sluice demo`, the embedded default: two vLLM simulator pools
# and the proxy on 127.0.0.1:8080, no Redis, PostgreSQL or Prometheus needed.
#   scripts/run.sh                      # = sluice demo
#   scripts/run.sh serve -c conf/sluice.yaml
# SLUICE_CARGO_PROFILE picks the cargo profile (default release).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/build-deps.sh
ensure_build_deps
[ $# -gt 0 ] || set -- demo
exec cargo run --locked --profile "${SLUICE_CARGO_PROFILE:-release}" --bin sluice -- "$@"
