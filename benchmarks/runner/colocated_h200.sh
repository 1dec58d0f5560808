#!/usr/bin/env bash
# The time-share experiment on one GPU (benchmarks/results/runner/colocated_h200.json) as one background job:
#
#   setsid benchmarks/runner/colocated_h200.sh RESULTS_DIR [STEPS] > RESULTS_DIR.log 2>&1 < /dev/null &
#
# and poll RESULTS_DIR/timeline.log; RESULTS_DIR/small.tgz (JSON, metrics, start-up timelines, CPU and GPU
# monitors, profile summaries, logs; no weights) is refreshed after every part, and copied to $OUT when set
# (a device call's output folder: run the script in the call's foreground, a few parts per call, so what
# finished comes back even if the machine is gone before the next call). Parts, in order:
#   prepare    `tandem prepare all`; tests/gpu starts beside it on an empty TANDEM_HOME (gpu_tests.log)
#   coldstart  `tandem sft` of the H200 recipe: 200 1-hop + 1,000 2-hop demonstrations (docs/LEARNING.md)
#   pilot      10 async time_share steps with rollout.pause_mode retract and in_place (no validation); the
#              faster is the pause mode of every run of the benchmark, sync and async alike (sync pauses
#              idle engines, so the mode changes nothing there); rollout.max_running_requests 512, as the
#              first pilot chose (benchmarks/results/runner/colocated_h200_pilot)
#   prefill    (beside prepare) the prefill-graph checks of tests/gpu (prefill_tests.log); if they fail, every run
#              below sets rollout.engine.prefill_cuda_graphs=false (the file prefill_graphs_off says so); after the
#              cold start, benchmarks/engine/engine_prefill_steps.py (engine_prefill_steps_h200.json)
#   warmup     WARMUP_STEPS (2) untimed steps of the sync recipe, so every timed run finds the machine as warm as the
#              others (the engine's kernel tuning, Triton's cache) and starts from the same compile cache (its
#              Inductor cache, copied fresh into each run; WARM_COMPILE=0: none); SKIP it in later calls on the
#              same machine
#   bench      benchmarks/runner/sync_vs_async.py --colocated --steps STEPS --monitor, one run at a time (packed
#              after each), each compiling in its own clock (benchmarks/runner/runs.py, run_env): the
#              parts in PARTS; steps 5 and 6 of the parts in PROFILE_PARTS (default: async_concurrent) are
#              profiled (runner.profile_steps) and left out of its means. On the H200 (2026-12-04, seventh
#              session, CUDA-graph prefill) a 40-step run took 2.1-2.9 minutes with its start-up; the install,
#              the prefill checks beside prepare, the cold start, the prefill benchmark and the warm-up took
#              4.5 minutes in one device call; then two timed parts per call (4.7-5.4 minutes)
#   decode     benchmarks/engine/engine_decode_steps.py on the cold-started model: decode step time against the
#              batch (64, 256, 512, 1024) and where a step goes (engine_decode_steps_h200.json)
#   ship       the kernel choices the engine's tuning made on this GPU (for tandemrl/engine/tuned)
# PARTS="sync async_time_share ..." picks the benchmark's runs (default: issue 35's four: sync, async_defaults (the
# recipe), async_time_share, async_concurrent); PART_EXTRA_<part>="key=value ..." adds overrides to one run (e.g. a
# variant's buffer sizes; async_concurrent's default is the concurrent runner as issue 35 found it: no correction,
# staleness bound 1). A part named async_defaults_<label> is the recipe with its PART_EXTRA, sync_<label> the sync
# recipe with its PART_EXTRA (ratios are always against the run named sync).
# FIRST_STEP=1 adds, before the warm-up, where the actor's compile goes (benchmarks/actor/first_step.py).
# SPEC=1 adds issue 39's part after the benchmark: the sync recipe without and with n-gram speculation (SPEC_STEPS, SPEC_EXTRA).
# SKIP="gputests pilot ..." leaves parts out; PAUSE_MODE skips the pilot's choice; MAX_RUNNING=N. SYNC_CFG, ASYNC_CFG, EXTRA
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
profile_parts=" ${PROFILE_PARTS-async_concurrent} "  # set and empty: profile none
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }
pack() {
    (cd "$out" && find . -path '*/checkpoints' -prune -o -path '*/inductor_cache' -prune -o -path '*/tensorboard' -prune -o -path '*/trajectories' \
        -prune -o -path ./gpu_tests_home -prune -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \
        -o -name '*.txt' -o -name '*.yaml' -o -name '*.png' \) -size -4M -print | tar czf small.tgz.tmp -T - \
        && mv small.tgz.tmp small.tgz)
    # run in the foreground of a device call, the pack also lands in the call's $OUT (as <results dir>.tgz), so
    # a machine lost before the next call keeps every part that finished
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp "$out/small.tgz" "$OUT/$(basename "$out").tgz"; fi
}
tandem() { python3 -m tandemrl.cli "$@"; }

if [[ $skip != *" gputests "* ]]; then
    stamp "tests/gpu on an empty TANDEM_HOME, in the background"
    mkdir -p "$out/gpu_tests_home"
    (TANDEM_HOME="$out/gpu_tests_home" timeout 900 python3 -m pytest -q -ra tests/gpu -m "gpu or not gpu" \
        -p no:cacheprovider > "$out/gpu_tests.log" 2>&1; echo "rc=$?" >> "$out/gpu_tests.log") &
    gputests=$!
fi
if [[ $skip != *" prefill "* ]]; then
    # correctness only, so it may share the GPU with prepare; the timings below wait for it
    stamp "prefill graph checks of tests/gpu, in the background"
    (timeout 600 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_fast_paths.py \
        -k "prefill_graphs or prefill_tiles" > "$out/prefill_tests.log" 2>&1; echo "rc=$?" >> "$out/prefill_tests.log") &
    prefilltests=$!
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
if [ -n "${prefilltests:-}" ]; then
    wait "$prefilltests"
    if ! grep -q "^rc=0$" "$out/prefill_tests.log"; then
        touch "$out/prefill_graphs_off"
        stamp "prefill graph checks failed (prefill_tests.log): every run below prefills eagerly"
    fi
    stamp "prefill graph checks: $(tail -2 "$out/prefill_tests.log" | tr '\n' ' ')"
    if [ ! -f "$out/prefill_graphs_off" ]; then
        stamp "prefill step times, eager against CUDA graphs"
        timeout 300 python3 -m benchmarks.engine.engine_prefill_steps --model-dir "${TANDEM_HOME:-$HOME/.cache/tandemrl}/models/SmolLM2-135M-Instruct-coldstart" \
            --out "$out/engine_prefill_steps_h200.json" > "$out/prefill_steps.log" 2>&1 || stamp "prefill step benchmark failed"
    fi
fi
if [ -f "$out/prefill_graphs_off" ]; then
    extra+=(rollout.engine.prefill_cuda_graphs=false)
fi
pack
if [[ $skip != *" decode "* ]]; then
    stamp "decode step times against the batch"
    timeout 300 python3 -m benchmarks.engine.engine_decode_steps --model-dir "${TANDEM_HOME:-$HOME/.cache/tandemrl}/models/SmolLM2-135M-Instruct-coldstart" \
        --out "$out/engine_decode_steps_h200.json" > "$out/decode_steps.log" 2>&1 || stamp "decode step benchmark failed"
    pack
fi

# the first H200 pilot (benchmarks/results/runner/colocated_h200_pilot) found 512 running requests faster than 256
max_running=${MAX_RUNNING:-512}
pause_mode=${PAUSE_MODE:-}
if [[ -z $pause_mode && $skip != *" pilot "* ]]; then
    for mode in retract in_place; do
        stamp "pilot: time_share, rollout.pause_mode=$mode, rollout.max_running_requests=$max_running"
        timeout 300 python3 -m tandemrl.cli train "$async_cfg" runner.output_dir="$out/pilot/$mode" \
            runner.max_steps="$pilot_steps" runner.val_interval=0 runner.val_before_train=false \
            cluster.colocated_policy=time_share rollout.pause_mode=$mode rollout.max_running_requests=$max_running \
            "${extra[@]}" > "$out/pilot_$mode.log" 2>&1 || stamp "pilot $mode failed"
        pack
    done
    pause_mode=$(python3 - "$out/pilot" <<'EOF'
import json, sys
from pathlib import Path
means = {}
for mode in ("retract", "in_place"):
    path = Path(sys.argv[1]) / mode / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.is_file() else []
    times = [r["time/step"] for r in rows if r.get("step", 0) >= 3 and "time/step" in r]
    if times:
        means[mode] = sum(times) / len(times)
json.dump({"mean_step_time_s_from_step_3": means}, open(Path(sys.argv[1]) / "pilot.json", "w"), indent=2)
print(min(means, key=means.get) if means else "retract")
EOF
)
    stamp "pilot: $(tr -d '\n ' < "$out/pilot/pilot.json") -> rollout.pause_mode=$pause_mode"
fi
pause_mode=${pause_mode:-in_place}  # the H200 recipes' own mode (the pilot skipped, PAUSE_MODE unset)

if [[ ${FIRST_STEP:-0} = 1 ]]; then
    # opt-in, before anything else compiles: the async recipe's actor alone in a cold Inductor cache, its build
    # (with the compile of trainer/actor.py warm_up) and first steps timed, without and with the warm-up
    # (benchmarks/actor/first_step.py): whether step 1 still traces a graph
    stamp "first step: the recipe's actor without and with its warm-up"
    for variant in no_warm_up warm_up; do
        flag=(); [ $variant = no_warm_up ] && flag=(--no-warm-up)
        timeout 300 python3 -m benchmarks.actor.first_step --config "$async_cfg" "${flag[@]}" \
            --out "$out/first_step_$variant.json" >> "$out/first_step.log" 2>&1 || stamp "first step $variant failed (see first_step.log)"
    done
    pack
fi
if [[ $skip != *" warmup "* ]]; then
    # Untimed, before any timed run: the machine's own state (the engine's kernel tuning in TANDEM_HOME, Triton's
    # kernel cache, the files a first compile reads) is then the same for every timed run. In the sixth
    # session's jobs sync ran first without it, and its first train step (the actor's compile, into an empty
    # Inductor cache in every run) took 19.7 and 18.2 s against 14.8-17.5 s in the async runs after it
    # (colocated_h200_loglinear{,_b1}/). Its Inductor cache is then the snapshot every timed run starts from,
    # a fresh copy each (runs.py, run_env; WARM_COMPILE=0: each run compiles cold in its own clock, as until
    # the seventh session).
    stamp "warm-up: ${WARMUP_STEPS:-2} untimed steps of the sync recipe"
    rm -rf "$out/warmup"
    TORCHINDUCTOR_CACHE_DIR="$out/warmup/inductor_cache" timeout 300 python3 -m tandemrl.cli train "$sync_cfg" \
        runner.output_dir="$out/warmup" runner.max_steps="${WARMUP_STEPS:-2}" runner.val_interval=0 \
        runner.val_before_train=false rollout.max_running_requests="$max_running" rollout.pause_mode="$pause_mode" \
        "${extra[@]}" > "$out/warmup.log" 2>&1 || stamp "warm-up failed (see warmup.log)"
    pack
fi

if [ -d "$out/warmup/inductor_cache" ] && [ "${WARM_COMPILE:-1}" = 1 ]; then
    # every timed run starts from its own copy of the warm-up's compile cache (benchmarks/runner/runs.py, run_env)
    export TANDEM_BENCH_WARM_INDUCTOR_CACHE="$out/warmup/inductor_cache"
fi
if [[ $skip != *" bench "* ]]; then
    # one run per call of the benchmark, packed after each: a machine lost mid-way keeps what was done
    settings=(rollout.max_running_requests="$max_running" rollout.pause_mode="$pause_mode")
    : "${PART_EXTRA_async_concurrent=algorithm.off_policy_correction=none algorithm.proximal_logprobs=recompute rollout_buffer.max_head_offpolicyness=1}"
    for part in ${PARTS:-sync async_defaults async_time_share async_concurrent}; do
        profile=()
        [[ $profile_parts == *" $part "* ]] && profile=("runner.profile_steps=$profile_steps")
        part_var="PART_EXTRA_$part"
        read -r -a part_extra <<< "${!part_var:-}"
        stamp "benchmark: $part, $steps steps (${settings[*]} ${profile[*]} ${part_extra[*]})"
        timeout 600 python3 -m benchmarks.runner.sync_vs_async --colocated --monitor --steps "$steps" --runs "$part" \
            --runs-dir "$out/runs" --sync-config "$sync_cfg" --async-config "$async_cfg" --no-plots \
            --out "$out/colocated_h200.json" "${settings[@]}" "${profile[@]}" "${extra[@]}" "${part_extra[@]}" >> "$out/bench.log" 2>&1 \
            || stamp "benchmark part $part failed (see bench.log)"
        pack
    done
    python3 -m benchmarks.runner.sync_vs_async --colocated --summarize-only --runs-dir "$out/runs" \
        --out "$out/colocated_h200.json" >> "$out/bench.log" 2>&1 || stamp "summary failed (see bench.log)"
    pack
fi
if [[ ${SPEC:-0} = 1 ]]; then
    # issue 39 (opt-in): the sync recipe without and with n-gram speculative decoding, SPEC_STEPS (20) steps
    # each, with SPEC_EXTRA (key=value) for the speculating run only (benchmarks/engine/speculative_h200.py)
    read -r -a spec_extra <<< "${SPEC_EXTRA:-}"
    stamp "speculative: the sync recipe without and with rollout.engine.speculative=ngram, ${SPEC_STEPS:-20} steps each"
    timeout 600 python3 -m benchmarks.engine.speculative_h200 --config "$sync_cfg" --runs-dir "$out/spec" \
        --steps "${SPEC_STEPS:-20}" --monitor --no-plots --out "$out/speculative_h200.json" --spec "${spec_extra[@]}" \
        -- rollout.max_running_requests="$max_running" rollout.pause_mode="$pause_mode" "${extra[@]}" >> "$out/spec.log" 2>&1 \
        || stamp "speculative benchmark failed (see spec.log)"
    pack
fi
if [[ $skip != *" ship "* ]]; then
    python3 -m tandemrl.engine.tuning_cache ship --from "${TANDEM_HOME:-$HOME/.cache/tandemrl}/cache/kernel_tuning" \
        --to "$out/tuned" > "$out/ship.log" 2>&1 || stamp "ship failed (see ship.log)"
fi
stamp "done"
pack
touch "$out/DONE"
