#!/usr/bin/env bash
# The whole learning experiment on one GPU, as run for benchmarks/results/sync_vs_async_h200.json:
# prepare the embedded defaults, size the cold start, evaluate it, then the sync and the async run of
# the same configuration (benchmarks/sync_vs_async.py), and the actor's training speed.
#
#   benchmarks/learning_h200.sh RESULTS_DIR [STEPS] [NUM_DEMOS] [key=value ...]
#
# The cold start is sized from its validation EM: the recipe asks for 0.2-0.45 overall with both
# question kinds above 0.05, so that every kind has reward variance within its groups. NUM_DEMOS is
# the first size tried; one retry halves or doubles it when the EM falls outside that band.
# Everything it prints goes to RESULTS_DIR/*.log; the JSON and plots to RESULTS_DIR.
set -euo pipefail
out=${1:?usage: $0 RESULTS_DIR [STEPS] [NUM_DEMOS] [key=value ...]}
steps=${2:-60}
demos=${3:-500}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
config_dir=examples/searchr1/config
sync_cfg=$config_dir/smollm2_h200_sync.yaml
tandem() { python3 -m tandemrl.cli "$@"; }
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/timeline.log"; }

stamp "prepare"
tandem prepare all > "$out/prepare.log" 2>&1

cold_start() {  # $1 = number of demonstrations, then overrides; prints "overall 1hop 2hop" val EM
    local n=$1
    shift
    tandem sft "$sync_cfg" actor.sft.num_demos="$n" runner.output_dir="$out/sft_$n" "$@" > "$out/sft_$n.log" 2>&1
    tandem eval "$sync_cfg" runner.output_dir="$out/sft_$n" "$@" --split val --limit 200 > "$out/eval_$n.log" 2>&1
    python3 - "$out/sft_$n/eval/val_summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(s["overall"]["em"], s.get("kb_1hop", {}).get("em", 0.0), s.get("kb_2hop", {}).get("em", 0.0))
EOF
}

stamp "cold start with $demos demonstrations"
read -r em em1 em2 < <(cold_start "$demos" "$@")
stamp "val EM after the cold start: overall $em, kb_1hop $em1, kb_2hop $em2"
retry=$(python3 -c "
em, em1, em2 = $em, $em1, $em2
print('fewer' if em > 0.45 else 'more' if (em < 0.2 or min(em1, em2) <= 0.05) else '')")
if [ -n "$retry" ]; then
    demos=$([ "$retry" = fewer ] && echo $((demos / 2)) || echo $((demos * 2)))
    stamp "outside 0.2-0.45 (or a kind at <= 0.05): $retry demonstrations, $demos"
    read -r em em1 em2 < <(cold_start "$demos" "$@")
    stamp "val EM after the cold start: overall $em, kb_1hop $em1, kb_2hop $em2"
fi
echo "$demos" > "$out/num_demos"

if [ -f benchmarks/trainer_smollm2.py ]; then
    stamp "actor speed"
    python3 benchmarks/trainer_smollm2.py --no-ablation --out "$out/trainer_smollm2_h200.json" > "$out/trainer.log" 2>&1 \
        || stamp "trainer benchmark failed (see trainer.log)"
fi

stamp "sync and async runs, $steps steps each"
python3 benchmarks/sync_vs_async.py --steps "$steps" --runs-dir "$out/runs" \
    --out "$out/sync_vs_async_h200.json" "$@" > "$out/sync_vs_async.log" 2>&1
stamp "done"
