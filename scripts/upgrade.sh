#!/usr/bin/env bash
# Zero-downtime binary upgrade: start the new binary with -u (it waits for the listening sockets),
# then SIGQUIT the running one, which hands its sockets over, closes its connections after their
# current response, drains in-flight streams and exits.
#   scripts/upgrade.sh /usr/local/bin/sluice.new /etc/sluice/sluice.yaml [/tmp/sluice.pid]
set -euo pipefail
new_bin=${1:?new binary}
config=${2:?config file}
pid_file=${3:-/tmp/sluice.pid}
old_pid=$(cat "$pid_file")
"$new_bin" serve --config "$config" -u -d   # daemonized; it writes the same pid file
sleep 1                                     # the new process is now waiting on the upgrade socket
kill -QUIT "$old_pid"
for _ in $(seq 1 60); do
  kill -0 "$old_pid" 2>/dev/null || { echo "upgraded: old pid $old_pid exited"; exit 0; }
  sleep 1
done
echo "old pid $old_pid still draining after 60 s" >&2
exit 1
