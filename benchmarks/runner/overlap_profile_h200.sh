#!/usr/bin/env bash
# Where the embedded engine's time goes in a real async time_share run on the H200, then the honest-clock
# benchmark (benchmarks/runner/colocated_h200.sh) on the same machine, as one background job:
#
#   setsid benchmarks/runner/overlap_profile_h200.sh RESULTS_DIR [STEPS] > RESULTS_DIR.log 2>&1 < /dev/null &
#
# Parts: prepare, cold start, a 12-step time_share run (no validation) whose engine process is sampled by
# py-spy (all threads, 15 s from step 5; `PYSPY` names the py-spy binary) and whose loop thread is
# cProfiled for engine steps 800-1100 (TANDEM_ENGINE_PROFILE, tandemrl/engine/loop.py), then
# colocated_h200.sh's benchmark of PARTS for STEPS steps with validation every 10 steps. RESULTS_DIR/small.tgz
# is refreshed after each part.
set -uo pipefail
out=${1:?usage: $0 RESULTS_DIR [STEPS]}
steps=${2:-40}
mkdir -p "$out/profile"
out=$(cd "$out" && pwd)
cfg=examples/searchr1/config/smollm2_h200_async.yaml
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }
pack() { (cd "$out" && tar czf small.tgz.tmp --exclude=small.tgz* --exclude='*/checkpoints' --exclude='*/tensorboard' \
    --exclude='*/trajectories' --exclude='*/sft/*safetensors' . && mv small.tgz.tmp small.tgz); }
stamp prepare
python3 -m tandemrl.cli prepare all > "$out/prepare.log" 2>&1 || { stamp "prepare failed"; pack; exit 1; }
stamp "cold start"
python3 -m tandemrl.cli sft "$cfg" runner.output_dir="$out/sft" > "$out/sft.log" 2>&1 || { stamp "sft failed"; pack; exit 1; }
rm -rf "$out/sft"
stamp "profiled time_share run"
run="$out/profile/run"
TANDEM_ENGINE_PROFILE="$out/profile/engine_loop.prof:800:300" timeout 400 python3 -m tandemrl.cli train "$cfg" \
    runner.output_dir="$run" runner.max_steps=12 runner.val_interval=0 runner.val_before_train=false \
    cluster.colocated_policy=time_share rollout.pause_mode=in_place rollout.max_running_requests=512 \
    > "$out/profile/train.log" 2>&1 &
train=$!
until [ "$(wc -l < "$run/metrics.jsonl" 2>/dev/null || echo 0)" -ge 4 ] || ! kill -0 $train 2>/dev/null; do sleep 1; done
pid=$(pgrep -f "serve-engine" | head -1)
stamp "py-spy on engine pid ${pid:-none}"
[ -n "$pid" ] && timeout 60 "${PYSPY:-py-spy}" record -p "$pid" -d 15 -r 250 --threads -f raw -o "$out/profile/engine_pyspy.txt" \
    > "$out/profile/pyspy.log" 2>&1
[ -n "$pid" ] && timeout 60 "${PYSPY:-py-spy}" dump -p "$pid" > "$out/profile/engine_dump.txt" 2>&1
wait $train
stamp "profiled run done"
python3 - "$out/profile/engine_loop.prof" > "$out/profile/engine_loop_top.txt" 2>&1 <<'PY'
import pstats, sys
stats = pstats.Stats(sys.argv[1])
stats.sort_stats("cumulative").print_stats(45)
stats.sort_stats("tottime").print_stats(30)
PY
pack
stamp "benchmark"
SKIP="gputests prepare coldstart decode pilot ship" PAUSE_MODE=in_place PROFILE_PARTS="" \
    bash benchmarks/runner/colocated_h200.sh "$out/bench" "$steps" >> "$out/bench.log" 2>&1
stamp done
pack
touch "$out/DONE"
