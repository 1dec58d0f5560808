#!/usr/bin/env bash
# Real vLLM / SGLang on the H200 (docs/BACKENDS.md, "On the H200"). Run ON the GPU machine, from the
# project root, with the project staged as ../shared/device/README.md says (PYTHONPATH=/tmp/site:$PWD),
# after every part of ENGINE's wheel set (../shared/device/engines/stage_engines.sh ENGINE OUTDIR) was
# copied to /tmp/eng_stage_ENGINE/pNN, one `run` per part.
#
#   benchmarks/engine/engines_h200.sh install ENGINE          join the parts, pip --target /tmp/eng_site_ENGINE (once)
#   benchmarks/engine/engines_h200.sh recipe ENGINE [STEPS [KEY=VALUE ...]]
#                                                      smollm2_h200_async.yaml ($RECIPE_CONFIG) on ENGINE, STEPS
#                                                      (20) steps, no validation, runner.weights_check_tokens=16
#                                                      (each segment fails unless every engine's greedy output
#                                                      is the actor's), then the overrides given. One segment
#                                                      per pause mode the engine has, each resumed from the
#                                                      last one's closing checkpoint into the same output_dir:
#                                                      vllm in_place; sglang and embedded retract, in_place,
#                                                      drain (steps split evenly, STEPS >= the modes)
#   benchmarks/engine/engines_h200.sh bench [BACKENDS [ARGS ...]]
#                                                      benchmarks/engine/engines_gpu.py for BACKENDS
#                                                      (embedded,vllm,vllm_eager,vllm_pinned,sglang: the installed ones run), with
#                                                      its further ARGS (e.g. --deadline-s 600)
#   benchmarks/engine/engines_h200.sh probe                   sglang only: benchmarks/engine/sglang_distributed.py, the
#                                                      update_weights_from_distributed calls on a gloo group
#   benchmarks/engine/engines_h200.sh all ENGINE [ARGS ...]    all of it for ENGINE: the install beside `tandem prepare
#                                                      all` and the cold start (`tandem sft` with $SFT_ARGS,
#                                                      unless it is there), the bench of ENGINE with ARGS,
#                                                      the recipe (20 steps, stopped after
#                                                      $RECIPE_TIMEOUT_S, 900), then (sglang) the probe,
#                                                      then the bench of embedded (engines_h200_embedded.json;
#                                                      not with EMBEDDED_BENCH=0); exits with the recipe's status
# Results go to ${OUT:-/tmp/engines_h200} (on a `run`, $OUT comes back): metrics.jsonl, weights_check.json,
# startup.json of each recipe run, engines_h200.json of the benchmark. The engine's wheels are seen by the
# engine server only (rollout.ENGINE.pythonpath), never by tandem's own processes.
set -euo pipefail
cmd=${1:?usage: engines_h200.sh install|recipe|bench|probe|all ...}
out=${OUT:-/tmp/engines_h200}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

site_of() { echo "/tmp/eng_site_$1"; }

install() {
  local eng=$1 stage=/tmp/eng_stage_$1 site
  site=$(site_of "$eng")
  [ -f "$site/.installed" ] && { echo "$eng: already in $site"; return; }
  ls "$stage"/p?? >/dev/null 2>&1 || { echo "no parts in $stage" >&2; exit 2; }
  cat "$stage"/p?? | tar x -C "$stage"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$stage"/*.whl
  touch "$site/.installed"
  PYTHONPATH=$site python3 -c "import $eng, torch; print('$eng', $eng.__version__, 'torch', torch.__version__)"
}

engine_overrides() {  # the engine's own environment and a GPU share that leaves room for the actor
  local eng=$1 site
  site=$(site_of "$eng")
  echo "rollout.backend=$eng"
  if [ "$eng" = vllm ]; then echo "rollout.vllm.pythonpath=[$site] rollout.vllm.gpu_memory_utilization=0.35"; fi
  if [ "$eng" = sglang ]; then echo "rollout.sglang.pythonpath=[$site] rollout.sglang.mem_fraction_static=0.35"; fi
}

pause_modes() {  # the pause modes ENGINE takes (vLLM has no retract: rollout/vllm_client.py)
  if [ "$1" = vllm ]; then echo in_place; else echo retract in_place drain; fi
}

case "$cmd" in
  install) install "${2:?engine: vllm or sglang}" ;;
  recipe)
    eng=${2:?engine: vllm, sglang or embedded}; steps=${3:-20}; run_dir=${RECIPE_DIR:-runs/engines_h200_$eng}
    shift $(( $# < 3 ? $# : 3 ))
    read -r -a modes <<< "$(pause_modes "$eng")"
    [ "$steps" -ge "${#modes[@]}" ] || { echo "recipe $eng: STEPS $steps < ${#modes[@]} pause modes" >&2; exit 2; }
    [ ! -e "$run_dir" ] || { echo "recipe $eng: $run_dir exists; move it away first" >&2; exit 2; }
    resume=()
    for k in $(seq 1 "${#modes[@]}"); do
      mode=${modes[k-1]} end=$(( steps * k / ${#modes[@]} ))
      echo "recipe $eng: steps to $end with rollout.pause_mode=$mode ${resume[*]}"
      # shellcheck disable=SC2046
      python3 -m tandemrl.cli train "${RECIPE_CONFIG:-examples/searchr1/config/smollm2_h200_async.yaml}" \
        runner.max_steps="$end" runner.val_interval=0 runner.val_before_train=false runner.weights_check_tokens=16 \
        runner.output_dir="$run_dir" rollout.pause_mode="$mode" "${resume[@]}" $(engine_overrides "$eng") "$@"
      # the segment's own check and start-up (the next segment writes its own over them)
      for f in weights_check.json startup.json config.yaml; do cp "$run_dir/$f" "$out/${eng}_${mode}_$f"; done
      for log in "$run_dir"/logs/*.log; do  # the servers' logs, cut to what comes back (head, tail, control calls)
        [ -f "$log" ] || continue
        name=$(basename "$log" .log)
        head -n 400 "$log" > "$out/${eng}_${mode}_${name}_head.log"
        tail -n 400 "$log" > "$out/${eng}_${mode}_${name}_tail.log"
        grep -E 'pause|continue|update_weights|flush|abort|Error|error' "$log" | tail -n 2000 \
          > "$out/${eng}_${mode}_${name}_control.log" || true
      done
      resume=("runner.resume_from=$run_dir/checkpoints/global_step_$end")  # a run always saves its last step
    done
    cp "$run_dir/metrics.jsonl" "$out/${eng}_metrics.jsonl"  # every segment's steps: one history
    python3 - "$out" "$eng" "$steps" "${modes[@]}" <<'PY'
import json, sys
out, eng, steps, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
rows = [json.loads(line) for line in open(f"{out}/{eng}_metrics.jsonl")]
versions = [int(r["rollout/weight_version"]) for r in rows]
checks = {m: json.load(open(f"{out}/{eng}_{m}_weights_check.json"))["weights_check"] for m in modes}
print(f"recipe {eng}: steps {[r['step'] for r in rows]}, weight versions {versions}, weights_check {checks}")
assert [r["step"] for r in rows] == list(range(1, steps + 1)) and versions == list(range(1, steps + 1))
assert all(checks.values())
PY
    ;;
  bench)
    args=()
    for eng in vllm sglang; do
      [ -f "$(site_of $eng)/.installed" ] && args+=("--$eng-pythonpath" "$(site_of $eng)")
    done
    backends=${2:-embedded,vllm,sglang}
    shift $(( $# < 2 ? $# : 2 ))
    python3 -m benchmarks.engine.engines_gpu --backends "$backends" "${args[@]}" --out "$out/${BENCH_JSON:-engines_h200.json}" "$@"
    ;;
  probe)
    python3 -m benchmarks.engine.sglang_distributed --sglang-pythonpath "$(site_of sglang)" \
      --out "$out/sglang_distributed.json"
    ;;
  all)
    eng=${2:?engine: vllm or sglang}
    shift 2
    bash "$0" install "$eng" > "$out/install_$eng.log" 2>&1 &  # beside the CPU-bound preparation
    installing=$!
    python3 -m tandemrl.cli prepare all
    coldstart=$(python3 -c "from tandemrl.host.home import default_coldstart_dir; print(default_coldstart_dir())")
    # shellcheck disable=SC2086
    [ -f "$coldstart/config.json" ] || python3 -m tandemrl.cli sft examples/searchr1/config/smollm2_h200_sync.yaml ${SFT_ARGS:-}
    wait "$installing" || { cat "$out/install_$eng.log"; exit 2; }
    # ENGINE's bench first (one start-up, its entry written at once), then the recipe, then (sglang) the
    # probe, then the embedded engine's bench beside it on the same machine (its own file; EMBEDDED_BENCH=0
    # leaves it out when device time is short)
    bash "$0" bench "$eng" "$@" || echo "bench $eng: exit $?"
    recipe=0
    # the rest still runs when the recipe fails or hangs: tandem's SIGTERM handler stops the launched
    # servers (docs/RELIABILITY.md), SIGKILL follows 60 s later
    timeout --kill-after=60 "${RECIPE_TIMEOUT_S:-900}" bash "$0" recipe "$eng" 20 || recipe=$?
    if [ "$eng" = sglang ]; then bash "$0" probe || echo "probe: exit $?"; fi
    if [ "${EMBEDDED_BENCH:-1}" = 1 ]; then
      BENCH_JSON=engines_h200_embedded.json bash "$0" bench embedded "$@" || echo "bench embedded: exit $?"
    fi
    exit "$recipe"
    ;;
  *) echo "unknown command $cmd (install, recipe, bench, probe, all)" >&2; exit 2 ;;
esac
