#!/usr/bin/env bash
# Run one command on the lent GPU machine with the project's staged wheels (../shared/device/README.md).
# Run ON that machine, from the project root, after each part of ../shared/device/stage.sh was copied to
# $STAGE_DIR/pNN (one `run` per part):
#
#   OUT=/tmp/bgout bash benchmarks/device/job.sh COMMAND [ARGS ...]
#
# Once per machine it checks the part count ($EXPECT_PARTS, when set), joins the parts and installs the
# wheels into $SITE_DIR with pip --target (no index, no dependencies). Then it records the card, the driver
# and the project's commit (.gitcommit, written here by `git rev-parse HEAD > .gitcommit` before the call:
# the machine gets a copy of the working tree without .git) in $OUT/gpu.txt, and runs COMMAND with
# PYTHONPATH=$SITE_DIR:$PWD, TANDEM_HOME=/tmp/th (unless set) and the hub offline. Its exit status is
# COMMAND's. benchmarks/device/start.sh runs it in the background; benchmarks/device/poll.sh waits for it.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: OUT=DIR job.sh COMMAND [ARGS ...]" >&2; exit 2; }
stage=${STAGE_DIR:-/tmp/stage}
site=${SITE_DIR:-/tmp/site}
out=${OUT:?set OUT: the folder whose files come back}
mkdir -p "$out"
if [ ! -f "$site/.installed" ]; then
  parts=$(find "$stage" -maxdepth 1 -name 'p[0-9][0-9]' 2>/dev/null | wc -l)
  [ "$parts" -gt 0 ] || { echo "job.sh: no staged parts in $stage (copy .stage/pNN/part to $stage/pNN)" >&2; exit 2; }
  if [ -n "${EXPECT_PARTS:-}" ] && [ "$parts" -ne "$EXPECT_PARTS" ]; then
    echo "job.sh: $parts parts in $stage, expected $EXPECT_PARTS: send the missing ones again" >&2
    exit 2
  fi
  cat "$stage"/p[0-9][0-9] | tar x -C "$stage"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$stage"/*.whl
  touch "$site/.installed"
fi
export PYTHONPATH="$site:$PWD" TANDEM_HOME=${TANDEM_HOME:-/tmp/th} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
{
  echo "commit: $(cat .gitcommit 2>/dev/null || echo 'unknown (no .gitcommit)')"
  echo "started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: $*"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "no nvidia-smi: no GPU here"
  fi
  echo "cpus: $(nproc)"
} > "$out/gpu.txt"
exec "$@"
