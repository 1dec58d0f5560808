#!/usr/bin/env bash
# Train with one of the example configs, like RLinf's recipe scripts:
#   examples/searchr1/run_train.sh CONFIG_NAME [key=value ...]
# CONFIG_NAME names examples/searchr1/config/CONFIG_NAME.yaml (e.g. embedded_cpu_async); the overrides
# are Hydra-style dotted keys (e.g. runner.max_steps=10 data.rollout_batch_size=8).
# Run it on the head node. On one machine it starts a local Ray; on several nodes start Ray first
# (`TANDEM_NODE_RANK=0 ray start --head` here, `TANDEM_NODE_RANK=<rank> ray start --address=<head>:6379`
# on the others: README "Placement and several nodes"). Add --dry-run to print the placement plan only.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 CONFIG_NAME [key=value ...]" >&2
    echo "configs:" >&2
    ls "$(dirname "$(readlink -f "$0")")/config" | sed -n 's/\.yaml$//p' | sed 's/^/  /' >&2
    exit 2
fi

CONFIG_NAME="$1"
shift
# the script's own folder, also when it is run through a link (examples/agent/searchr1/run_train.sh, the
# path RLinf's recipe uses)
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
CONFIG_PATH="$HERE/config/${CONFIG_NAME%.yaml}.yaml"
if [ ! -f "$CONFIG_PATH" ]; then
    echo "$0: no config $CONFIG_PATH; choose one of:" >&2
    ls "$HERE/config" | sed -n 's/\.yaml$//p' | sed 's/^/  /' >&2
    exit 2
fi

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
TANDEM="${TANDEM:-tandem}"
if ! command -v "$TANDEM" >/dev/null 2>&1; then
    TANDEM="python -m tandemrl.cli"
fi
exec $TANDEM train "$CONFIG_PATH" "$@"
