#!/usr/bin/env bash
# Flame graphs of the overhead bench's proxies (issue 13 item 5): bare Pingora, Sluice, Sluice +
# PostgreSQL ledger, Sluice + ledger + Redis admission. For each, `perf record` of the proxy
# process (cpu-clock at 999 Hz, frame-pointer stacks) during one wrk run at 16 connections,
# folded and drawn by inferno into
#   bench/flamegraphs/<config>.svg         pingora-bare, sluice, sluice-ledger, sluice-ledger-redis
#   bench/flamegraphs/<config>.folded.gz   the folded stacks the SVG is drawn from
#   bench/flamegraphs/SHARES.md            threads, Sluice's own frames and a comparison table,
#                                          computed from the folded stacks
# after the usual `sluice-bench overhead` table at 16 connections (printed, not written anywhere).
#
#   bench/flamegraphs.sh [seconds per run, default 10] [output dir, default bench/flamegraphs]
#
# The build: the shipped release profile, plus `-C force-frame-pointers=yes` so perf can walk the
# stacks (DWARF unwinding of the plain release build stops at the first tokio task frame: Pingora's
# request futures live in stack frames larger than the 64 KiB perf copies per sample). The flags
# change every crate's code, so this builds in its own target directory
# (FLAME_TARGET_DIR, default target/flamegraph: a full build the first time, ~10 min on 2 cores)
# and never touches target/release. The release profile's `debug = false` stays: function names
# come from the symbol table, inlined functions are counted in their callers. Frame pointers cost
# a few % of throughput; the graphs are for proportions, not for the req/s figures.
#
# Needs perf, wrk, nginx, gzip, inferno (`cargo install inferno --locked`), PostgreSQL at
# postgres@127.0.0.1:5432/test and Redis at 127.0.0.1:6379 (rows whose service is missing are
# skipped, as in the overhead bench). Run as root or with kernel.perf_event_paranoid <= 1.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
OUT=${2:-bench/flamegraphs}
TARGET=${FLAME_TARGET_DIR:-target/flamegraph}
for tool in perf wrk nginx gzip; do
    command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
if ! command -v inferno-flamegraph >/dev/null || ! command -v inferno-collapse-perf >/dev/null; then
    echo "installing inferno (cargo install inferno --locked)" >&2
    cargo install inferno --locked
fi
RUSTFLAGS="${RUSTFLAGS:-} -C force-frame-pointers=yes" CARGO_TARGET_DIR="$TARGET" \
    cargo build --release --bins
mkdir -p "$OUT"
"$TARGET/release/sluice-bench" overhead --sluice-bin "$TARGET/release/sluice" \
    --seconds "$SECS" --connections 16 --flamegraphs "$OUT"
ls -l "$OUT"
