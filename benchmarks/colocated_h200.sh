#!/usr/bin/env bash
# The time-share experiment on one GPU (benchmarks/results/colocated_h200.json) as one background job:
#
#   setsid benchmarks/colocated_h200.sh RESULTS_DIR [STEPS] > RESULTS_DIR.log 2>&1 < /dev/null &
#
# and poll RESULTS_DIR/timeline.log; RESULTS_DIR/small.tgz (JSON, metrics, start-up timelines, CPU and GPU
# monitors, profile summaries, logs; no weights) is refreshed after every part. Parts, in order:
#   prepare    `tandem prepare all`; tests/gpu starts beside it on an empty TANDEM_HOME (gpu_tests.log)
#   coldstart  `tandem sft` of the H200 recipe: 200 1-hop + 1,000 2-hop demonstrations (docs/LEARNING.md)
#   pilot      10 async time_share steps at rollout.max_running_requests 256 and 512 (no validation); the
#              faster is the engine setting of every run of the benchmark, sync and async alike
#   bench      benchmarks/sync_vs_async.py --colocated --steps STEPS --monitor: sync, async time_share,
#              async concurrent, the faster async with tis; steps 5 and 6 of each run are profiled
#              (runner.profile_steps) and left out of its means
#   ship       the kernel choices the engine's tuning made on this GPU (for tandemrl/engine/tuned)
# SKIP="pilot ..." leaves parts out; MAX_RUNNING=N skips the pilot's choice. SYNC_CFG, ASYNC_CFG, EXTRA
# (key=value for every run), PILOT_STEPS and PROFILE_STEPS let the script run on the CPU configs.
set -uo pipefail
out=${1:?usage: $0 RESULTS_DIR [STEPS]}
steps=${2:-60}
skip=" ${SKIP:-} "
mkdir -p "$out"
out=$(cd "$out" && pwd)
sync_cfg=${SYNC_CFG:-examples/searchr1/config/smollm2_h200_sync.yaml}
async_cfg=${ASYNC_CFG:-examples/searchr1/config/smollm2_h200_async.yaml}
read -r -a extra <<< "${EXTRA:-}"
pilot_steps=${PILOT_STEPS:-10}
profile_steps=${PROFILE_STEPS:-[5,6]}
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }
pack() {
    (cd "$out" && find . -path '*/checkpoints' -prune -o -path '*/tensorboard' -prune -o -path '*/trajectories' \
        -prune -o -path ./gpu_tests_home -prune -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \
        -o -name '*.txt' -o -name '*.yaml' -o -name '*.png' \) -size -4M -print | tar czf small.tgz.tmp -T - \
        && mv small.tgz.tmp small.tgz)
}
tandem() { python3 -m tandemrl.cli "$@"; }

if [[ $skip != *" gputests "* ]]; then
    stamp "tests/gpu on an empty TANDEM_HOME, in the background"
    mkdir -p "$out/gpu_tests_home"
    (TANDEM_HOME="$out/gpu_tests_home" timeout 900 python3 -m pytest -q -ra tests/gpu -m "gpu or not gpu" \
        -p no:cacheprovider > "$out/gpu_tests.log" 2>&1; echo "rc=$?" >> "$out/gpu_tests.log") &
    gputests=$!
fi
if [[ $skip != *" prepare "* ]]; then
    stamp "prepare"
    tandem prepare all > "$out/prepare.log" 2>&1 || { stamp "prepare failed"; pack; exit 1; }
fi
if [[ $skip != *" coldstart "* ]]; then
    stamp "cold start (tandem sft)"
    tandem sft "$sync_cfg" runner.output_dir="$out/sft" "${extra[@]}" > "$out/sft.log" 2>&1 || { stamp "sft failed"; pack; exit 1; }
fi
if [ -n "${gputests:-}" ]; then
    stamp "waiting for tests/gpu (timings below must not share the GPU with it)"
    wait "$gputests"
    stamp "tests/gpu: $(tail -3 "$out/gpu_tests.log" | tr '\n' ' ')"
fi
pack

max_running=${MAX_RUNNING:-}
if [[ -z $max_running && $skip != *" pilot "* ]]; then
    for n in 256 512; do
        stamp "pilot: time_share, rollout.max_running_requests=$n"
        timeout 300 python3 -m tandemrl.cli train "$async_cfg" runner.output_dir="$out/pilot/mr$n" runner.max_steps="$pilot_steps" \
            runner.val_interval=0 runner.val_before_train=false cluster.colocated_policy=time_share \
            rollout.max_running_requests=$n "${extra[@]}" > "$out/pilot_mr$n.log" 2>&1 || stamp "pilot $n failed"
    done
    max_running=$(python3 - "$out/pilot" <<'EOF'
import json, sys
from pathlib import Path
means = {}
for n in (256, 512):
    path = Path(sys.argv[1]) / f"mr{n}" / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.is_file() else []
    times = [r["time/step"] for r in rows if r.get("step", 0) >= 3 and "time/step" in r]
    if times:
        means[n] = sum(times) / len(times)
json.dump({"mean_step_time_s_steps_3_10": means}, open(Path(sys.argv[1]) / "pilot.json", "w"), indent=2)
print(min(means, key=means.get) if means else 256)
EOF
)
    stamp "pilot: $(cat "$out/pilot/pilot.json" | tr -d '\n ') -> rollout.max_running_requests=$max_running"
    pack
fi
max_running=${max_running:-256}

if [[ $skip != *" bench "* ]]; then
    stamp "benchmark: sync, async per colocated policy, best + tis; $steps steps each"
    timeout 1500 python3 benchmarks/sync_vs_async.py --colocated --monitor --steps "$steps" --runs-dir "$out/runs" \
        --sync-config "$sync_cfg" --async-config "$async_cfg" --out "$out/colocated_h200.json" \
        rollout.max_running_requests="$max_running" "runner.profile_steps=$profile_steps" "${extra[@]}" \
        > "$out/bench.log" 2>&1 || stamp "benchmark failed (see bench.log)"
    pack
fi
if [[ $skip != *" ship "* ]]; then
    python3 -m tandemrl.engine.tuning_cache ship --from "${TANDEM_HOME:-$HOME/.cache/tandemrl}/cache/kernel_tuning" \
        --to "$out/tuned" > "$out/ship.log" 2>&1 || stamp "ship failed (see ship.log)"
fi
stamp "done"
pack
touch "$out/DONE"
