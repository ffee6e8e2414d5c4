#!/usr/bin/env bash
# The whole benchmark in one command: builds both binaries (release), then runs every scenario in
# every mode (in-process model and live HTTP), the proxy-overhead comparison with nginx and the
# soak, and rewrites this harness's sections of bench/RESULTS.md and bench/results/*.
#   bench/run.sh [sluice-bench all options, e.g. --soak-minutes 10 --sla-signal harness]
# Needs wrk and nginx; PostgreSQL (postgres@127.0.0.1:5432/test) and Redis (127.0.0.1:6379) for
# the ledger-fed SLA signal and the ledger + Redis overhead row (see bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
exec "${CARGO_TARGET_DIR:-target}/release/sluice-bench" all "$@"
