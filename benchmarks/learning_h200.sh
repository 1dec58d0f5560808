#!/usr/bin/env bash
# The whole learning experiment on one GPU, as run for benchmarks/results/sync_vs_async_h200.json:
# prepare the embedded defaults; cold-start candidates side by side, each evaluated, one chosen; the
# actor's speed alone and next to generation under MPS, per engine SM cap; then the sync and the async
# run of the same configuration (benchmarks/sync_vs_async.py) under MPS with the best cap.
#
#   benchmarks/learning_h200.sh RESULTS_DIR [STEPS] [key=value ...]
#
# Cold start: the recipe asks for val EM 0.2-0.45 overall with both question kinds above 0.05, so that
# both have reward variance within their groups (docs/LEARNING.md). A mixed cold start teaches 1-hop
# long before the second search of 2-hop, so the candidates are 2-hop-heavy mixes
# (actor.sft.num_demos_per_source); benchmarks/coldstart_choice.py picks the one in the band with the
# most 2-hop EM, and it becomes the `coldstart` model both runs start from.
# Everything it prints goes to RESULTS_DIR/*.log; the JSON and plots to RESULTS_DIR.
set -euo pipefail
out=${1:?usage: $0 RESULTS_DIR [STEPS] [key=value ...]}
steps=${2:-60}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out/cs"
sync_cfg=examples/searchr1/config/smollm2_h200_sync.yaml
tandem() { python3 -m tandemrl.cli "$@"; }
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }
home=${TANDEM_HOME:-$HOME/.cache/tandemrl}

stamp "prepare"
tandem prepare all > "$out/prepare.log" 2>&1

# one retrieval server for all candidates (each would otherwise start its own on the same index)
port=18100
tandem serve-retrieval --index "$home/index/kb-seed0-minilm" --port $port > "$out/retrieval.log" 2>&1 &
retrieval=$!
trap 'kill $retrieval 2>/dev/null || true' EXIT
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

candidate() {  # $1 tag, then per-source counts source=count; SFT then greedy val EM, memory shared 3 ways
    local tag=$1 mix=()
    shift
    for pair in "$@"; do mix+=("actor.sft.num_demos_per_source.${pair%%=*}=${pair#*=}"); done
    tandem sft "$sync_cfg" actor.sft.num_demos=null "${mix[@]}" actor.micro_batch_tokens=16384 \
        actor.sft.out_dir="$out/cs/$tag" runner.output_dir="$out/sft_$tag" "${search[@]}" > "$out/sft_$tag.log" 2>&1
    tandem eval "$sync_cfg" rollout.model.model_path="$out/cs/$tag" rollout.engine.kv_cache_gb=12 \
        runner.output_dir="$out/sft_$tag" "${search[@]}" --split val --limit 200 > "$out/eval_$tag.log" 2>&1
}

stamp "cold-start candidates"
pids=()
candidate m300_1500 kb_1hop=300 kb_2hop=1500 & pids+=($!)
candidate m150_1500 kb_1hop=150 kb_2hop=1500 & pids+=($!)
candidate m300_2500 kb_1hop=300 kb_2hop=2500 & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || stamp "a candidate failed (see its sft_/eval_ log)"; done
kill $retrieval 2>/dev/null || true
chosen=$(python3 benchmarks/coldstart_choice.py "$out" --out "$out/coldstart_h200_mix.json")
stamp "cold start chosen: $chosen ($(python3 -c "import json; print(json.load(open('$out/coldstart_h200_mix.json'))['chosen_val'])"))"
rm -rf "$home/models/SmolLM2-135M-Instruct-coldstart"
cp -r "$out/cs/$chosen" "$home/models/SmolLM2-135M-Instruct-coldstart"

stamp "actor speed, alone and shared per engine SM cap"
python3 benchmarks/trainer_smollm2.py --no-ablation --mps --engine-sm-percents 100,50,30 \
    --out "$out/trainer_smollm2_h200.json" > "$out/trainer.log" 2>&1 || stamp "trainer benchmark failed (see trainer.log)"
cap=$(python3 -c "import json; print(json.load(open('$out/trainer_smollm2_h200.json'))['best_engine_sm_percent'])" 2>/dev/null || echo 100)
stamp "engine SM cap for the async run: $cap"

stamp "sync and async runs, $steps steps each"
python3 benchmarks/sync_vs_async.py --steps "$steps" --runs-dir "$out/runs" --out "$out/sync_vs_async_h200.json" \
    cluster.mps=true "cluster.mps_sm_percent.rollout=$cap" "$@" > "$out/sync_vs_async.log" 2>&1
stamp "done"
