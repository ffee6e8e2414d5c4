#!/usr/bin/env bash
# Proxy overhead at fixed concurrency (1, 16, 64 connections) with wrk: a static backend directly,
# nginx as a plain reverse proxy, Sluice, and Sluice with the ledger and Redis admission.
# Now a wrapper around `sluice-bench overhead` (bench/src/overhead.rs); prints the table.
#   bench/overhead.sh [path/to/sluice] [seconds per run]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/sluice}
SECS=${2:-8}
exec "$(dirname "$BIN")/sluice-bench" overhead --sluice-bin "$BIN" --seconds "$SECS"
