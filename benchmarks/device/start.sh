#!/usr/bin/env bash
# Start benchmarks/device/job.sh in the background, detached from the `run` call (setsid), then wait for it
# as poll.sh does. On the lent machine, from the project root:
#
#   bash benchmarks/device/start.sh SECONDS COMMAND [ARGS ...]
#
# The job writes into $JOB_DIR (/tmp/job): log (its stdout and stderr), rc (its exit status, once it
# ended) and out/ (its $OUT). A job already started on this machine is never started twice: the call only
# waits for it. Follow with `bash benchmarks/device/poll.sh SECONDS`, call after call, until it says the
# job ended.
set -euo pipefail
wait_s=${1:?usage: start.sh SECONDS COMMAND [ARGS ...]}
shift
[ $# -gt 0 ] || { echo "usage: start.sh SECONDS COMMAND [ARGS ...]" >&2; exit 2; }
job=${JOB_DIR:-/tmp/job}
here=$(cd "$(dirname "$0")" && pwd)
if [ -e "$job/started" ]; then
  echo "start.sh: a job started here at $(cat "$job/started"); waiting for it instead"
else
  mkdir -p "$job/out"
  date -u +%Y-%m-%dT%H:%M:%SZ > "$job/started"
  printf '%q ' "$@" > "$job/command"
  JOB_RC="$job/rc" OUT="$job/out" setsid nohup bash -c 'bash "$0" "$@"; echo $? > "$JOB_RC"' "$here/job.sh" "$@" \
    > "$job/log" 2>&1 < /dev/null &
fi
JOB_DIR=$job exec bash "$here/poll.sh" "$wait_s"
