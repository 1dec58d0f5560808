#!/usr/bin/env bash
# The whole learning experiment on one GPU, as run for benchmarks/results/runner/sync_vs_async_h200.json. Its
# parts, in order, the most wanted first:
#   prepare    the embedded defaults
#   coldstart  candidates side by side, each evaluated, one chosen; it becomes the `coldstart` model
#   runs       the sync and the async run of the same configuration (benchmarks/runner/sync_vs_async.py)
#   ttfs       time to the first step: a fresh machine without and with shipped kernel choices, then a
#              second start (benchmarks/runner/time_to_first_step.py)
#   gputests   tests/gpu
#   actor      the actor's speed alone (also compiled, and its top kernels) and next to generation under
#              MPS per engine SM cap (benchmarks/actor/trainer_smollm2.py)
#   offpolicy  the async run again with algorithm.off_policy_correction=tis, against the same sync run
#
#   benchmarks/learning/learning_h200.sh RESULTS_DIR [STEPS] [key=value ...]
#   CANDIDATES="tag:source=count,source=count ..."  the cold-start mixes (default: the config's mix and
#                                                   two neighbours: kb_2hop EM rises steeply with the
#                                                   number of 2-hop demonstrations)
#   SKIP="prepare coldstart ..."                    leaves those parts out (e.g. a second round on a
#                                                   machine that already ran some)
#   SYNC_CFG, ASYNC_CFG, VAL_LIMIT                  the pair's configs (the H200 ones) and how many val
#                                                   questions a candidate is judged on (200); with the
#                                                   CPU configs and tiny sizes the script runs on a CPU
#
# Cold start: the recipe asks for val EM 0.2-0.45 overall with both question kinds above 0.05, so that
# both have reward variance within their groups (docs/LEARNING.md). A mix as drawn teaches 1-hop long
# before the second search of 2-hop, hence 2-hop-heavy mixes (actor.sft.num_demos_per_source);
# benchmarks/learning/coldstart_choice.py picks the one in the band with the best weakest source.
# Each part after the cold start has a time limit, so that one that hangs does not cost the rest.
# Everything it prints goes to RESULTS_DIR/*.log. RESULTS_DIR/small.tgz, refreshed after every part,
# holds only the JSON, metrics, plots and logs (no weights, checkpoints, TensorBoard or per-trajectory
# files): what to bring back from a machine that returns small files only.
set -euo pipefail
out=${1:?usage: $0 RESULTS_DIR [STEPS] [key=value ...]}
steps=${2:-60}
shift $(( $# < 2 ? $# : 2 ))
overrides=("$@")  # key=value for every sft, eval and train the script runs
mkdir -p "$out/cs"
sync_cfg=${SYNC_CFG:-examples/searchr1/config/smollm2_h200_sync.yaml}
async_cfg=${ASYNC_CFG:-examples/searchr1/config/smollm2_h200_async.yaml}
pair=(--sync-config "$sync_cfg" --async-config "$async_cfg")
tandem() { python3 -m tandemrl.cli "$@"; }
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }
pack() {  # small.tgz: JSON, metrics, plots, configs and logs; per-trajectory files and weights left out
    (cd "$out" && find . -path ./cs -prune -o -path '*/checkpoints' -prune -o -path '*/tensorboard' -prune \
        -o -path '*/trajectories' -prune -o -type f \( -name '*.json' -o -name 'metrics.jsonl' \
        -o -name 'startup_marks.jsonl' -o -name '*.png' -o -name '*.log' -o -name '*.yaml' \) -size -2M -print \
        | tar czf small.tgz.tmp -T - && mv small.tgz.tmp small.tgz)
    if [ "$(stat -c %s "$out/small.tgz")" -gt 15000000 ]; then  # over what a device call returns: JSON only
        (cd "$out" && find . -path ./cs -prune -o -type f \( -name '*.json' -o -name 'metrics.jsonl' \) -size -2M \
            -print | tar czf small.tgz -T -)
    fi
}
limit() {  # limit SECONDS CMD...: CMD in a process group of its own, stopped whole after SECONDS (a run's
    # tandem train with it; the run's reaper then stops its Ray, servers and MPS daemon)
    local seconds=$1 pid watchdog rc
    shift
    setsid "$@" &
    pid=$!
    ( sleep "$seconds"; kill -TERM -- "-$pid" 2>/dev/null; sleep 20; kill -KILL -- "-$pid" 2>/dev/null ) &
    watchdog=$!
    rc=0
    wait "$pid" || rc=$?
    kill "$watchdog" 2>/dev/null || true
    return $rc
}
home=${TANDEM_HOME:-$HOME/.cache/tandemrl}
skip=" ${SKIP:-} "
candidates=${CANDIDATES:-"m200_1000:kb_1hop=200,kb_2hop=1000 m200_900:kb_1hop=200,kb_2hop=900 m200_1200:kb_1hop=200,kb_2hop=1200"}

if [[ $skip != *" prepare "* ]]; then
    stamp "prepare"
    tandem prepare all > "$out/prepare.log" 2>&1
fi

candidate() {  # $1 = tag:source=count ...; SFT then greedy val EM, the GPU's memory shared 3 ways
    local tag=${1%%:*} mix=() pair
    for pair in ${1#*:}; do mix+=("actor.sft.num_demos_per_source.${pair%%=*}=${pair#*=}"); done
    tandem sft "$sync_cfg" "${mix[@]}" actor.micro_batch_tokens=16384 actor.sft.out_dir="$out/cs/$tag" \
        runner.output_dir="$out/sft_$tag" "${search[@]}" "${overrides[@]}" > "$out/sft_$tag.log" 2>&1
    tandem eval "$sync_cfg" rollout.model.model_path="$out/cs/$tag" rollout.engine.kv_cache_gb=12 \
        runner.output_dir="$out/sft_$tag" "${search[@]}" "${overrides[@]}" --split val --limit "${VAL_LIMIT:-200}" \
        > "$out/eval_$tag.log" 2>&1
}

cold_start() {
    # one retrieval server for all candidates: Qdrant's local mode lets one process open the index
    local port=18100 retrieval pids=() c
    # python itself in the background (not the tandem function's subshell): $! must be the server
    python3 -m tandemrl.cli serve-retrieval --index "$home/index/kb-seed0-minilm" --port $port \
        > "$out/retrieval.log" 2>&1 &
    retrieval=$!
    python3 - $port <<'EOF'
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("retrieval server not healthy after 300 s")
EOF
    search=(retrieval.launch=false "tools.search.server_addr=127.0.0.1:$port")
    for c in $candidates; do candidate "${c//,/ }" & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || stamp "a candidate failed (see its sft_/eval_ log)"; done
    kill $retrieval
    wait $retrieval || true  # its index lock must be released before a run opens the index
    chosen=$(python3 -m benchmarks.learning.coldstart_choice "$out" --out "$out/coldstart_h200_mix.json")
    stamp "cold start chosen: $chosen ($(python3 -c "import json; print(json.load(open('$out/coldstart_h200_mix.json'))['chosen_val'])"))"
    rm -rf "$home/models/SmolLM2-135M-Instruct-coldstart"
    cp -r "$out/cs/$chosen" "$home/models/SmolLM2-135M-Instruct-coldstart"
}

if [[ $skip != *" coldstart "* ]]; then
    stamp "cold-start candidates"
    cold_start
    pack
fi

if [[ $skip != *" runs "* ]]; then
    stamp "sync and async runs, $steps steps each"
    limit 1500 python3 -m benchmarks.runner.sync_vs_async "${pair[@]}" --steps "$steps" --runs-dir "$out/runs" \
        --out "$out/sync_vs_async_h200.json" "${overrides[@]}" > "$out/sync_vs_async.log" 2>&1 || stamp "sync_vs_async failed (see sync_vs_async.log)"
    pack
fi

if [[ $skip != *" ttfs "* ]]; then
    stamp "time to first step: a fresh machine without and with shipped kernel choices, then a second start"
    limit 600 python3 -m benchmarks.runner.time_to_first_step --config "$async_cfg" --sequence cold,shipped,warm --tag h200 \
        --runs-dir "$out/ttfs" --out "$out/time_to_first_step_h200.json" "${overrides[@]}" > "$out/ttfs.log" 2>&1 \
        || stamp "time_to_first_step failed (see ttfs.log)"
    # the choices this GPU's tuning made, to ship with the package (tandemrl/engine/tuned)
    python3 -m tandemrl.engine.tuning_cache ship --from "$out/ttfs/run1/tuning" --to "$out/tuned" >> "$out/ttfs.log" 2>&1 || true
    pack
fi

if [[ $skip != *" gputests "* ]]; then
    stamp "GPU tests"
    limit 600 python3 -m pytest -q tests/gpu -m "gpu or not gpu" > "$out/gpu_tests.log" 2>&1 || stamp "GPU tests failed (see gpu_tests.log)"
    pack
fi

if [[ $skip != *" actor "* ]]; then
    stamp "actor speed, alone and shared per engine SM cap"
    limit 480 python3 -m benchmarks.actor.trainer_smollm2 --no-ablation --profile --compile-variant --mps --engine-sm-percents 100,50 \
        --out "$out/trainer_smollm2_h200.json" > "$out/trainer.log" 2>&1 || stamp "trainer benchmark failed (see trainer.log)"
fi
if [[ $skip != *" offpolicy "* ]]; then
    stamp "async with the tis correction"
    { limit 900 python3 -m benchmarks.runner.sync_vs_async "${pair[@]}" --only async --steps "$steps" --runs-dir "$out/runs_tis" \
          "${overrides[@]}" algorithm.off_policy_correction=tis \
      && python3 -m benchmarks.runner.sync_vs_async --from-runs "$out/runs/sync" "$out/runs_tis/async" \
          --out "$out/sync_vs_async_h200_tis.json"; } > "$out/offpolicy.log" 2>&1 || stamp "tis run failed (see offpolicy.log)"
fi
stamp "done"
pack
