#!/usr/bin/env bash
# What a new page-cache page costs this machine. On a virtual machine whose host backs guest
# memory lazily and takes freed pages back (virtio-balloon free page reporting), the first
# write to a page the guest has not touched lately costs a host-side fault: every byte a
# growing file adds (a request log, PostgreSQL's heap, WAL and index pages) pays it, in the
# writing process's CPU, and req/s falls as the files grow. Run before reading a ledger or log
# figure from bench/RESULTS.md on a new machine.
#   bench/first_touch.sh [MiB] [seconds to wait before the last write]
# Prints MB/s of three writes of the same size to a file in /tmp: into fresh pages, at once
# into the pages the first one freed, and into pages freed SECONDS earlier.
set -euo pipefail
MB=${1:-1024}
WAIT=${2:-15}
f=$(mktemp /tmp/sluice-first-touch.XXXXXX)
trap 'rm -f "$f"' EXIT
write() {
  local t0 t1
  t0=$(date +%s.%N)
  dd if=/dev/zero of="$f" bs=1M count="$MB" status=none
  t1=$(date +%s.%N)
  rm -f "$f"
  awk -v mb="$MB" -v a="$t0" -v b="$t1" -v what="$1" \
    'BEGIN {printf "%-40s %7.0f MB/s (%.2f s for %d MiB)\n", what, mb * 1.048576 / (b - a), b - a, mb}'
}
write "fresh pages"
write "pages freed just before"
sleep "$WAIT"
write "pages freed ${WAIT} s before"
grep -q . /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null &&
  echo "free page reporting: on (order $(cat /sys/module/page_reporting/parameters/page_reporting_order))" || true
