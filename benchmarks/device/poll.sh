#!/usr/bin/env bash
# Wait up to SECONDS for the job start.sh began, then pack what it has so far into $OUT (what a `run`
# brings back): job.log, job.rc once it ended, and the job's own out/ as out.tgz (logs, JSON, metrics;
# files over 4 MiB inside it are left out and named in skipped.txt, so the archive stays under the 16 MiB
# a file may have). Prints the log's tail and whether the job ended. Exit status: 0 while it runs or after
# it succeeded, else the job's.
#
#   bash benchmarks/device/poll.sh SECONDS
set -uo pipefail
wait_s=${1:?usage: poll.sh SECONDS}
job=${JOB_DIR:-/tmp/job}
out=${OUT:?set OUT: the folder whose files come back}
[ -e "$job/started" ] || { echo "poll.sh: no job on this machine ($job/started is missing): it was given back" >&2; exit 3; }
deadline=$(( $(date +%s) + wait_s ))
while [ ! -e "$job/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do
  sleep 5
done
mkdir -p "$out"
cp "$job/log" "$out/job.log" 2>/dev/null
(cd "$job/out" && find . -type f -size +4M) > "$out/skipped.txt"
tar czf "$out/out.tgz" -C "$job/out" --exclude-from="$out/skipped.txt" . 2>/dev/null
[ -s "$out/skipped.txt" ] || rm -f "$out/skipped.txt"
tail -n 25 "$job/log"
if [ -e "$job/rc" ]; then
  rc=$(cat "$job/rc")
  cp "$job/rc" "$out/job.rc"
  echo "poll.sh: the job ended with status $rc (started $(cat "$job/started"))"
  exit "$rc"
fi
echo "poll.sh: still running (started $(cat "$job/started")); poll again at once"
