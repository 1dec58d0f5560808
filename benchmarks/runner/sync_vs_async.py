"""The sync-vs-async reference table: the same configuration run by both runners for the same steps.

    python -m benchmarks.runner.sync_vs_async --steps 60 [--out benchmarks/results/runner/sync_vs_async_h200.json]
        [--sync-config C] [--async-config C] [--runs-dir runs/sync_vs_async] [key=value ...]
    python -m benchmarks.runner.sync_vs_async --from-runs SYNC_RUN_DIR ASYNC_RUN_DIR --out ...
    python -m benchmarks.runner.sync_vs_async --colocated --steps 60 --monitor \
        --out benchmarks/results/runner/colocated_h200.json      # sync, async per cluster.colocated_policy, best + tis

`--colocated` (one GPU shared by the actor and the engine): sync, then async under each
`cluster.colocated_policy` (time_share, concurrent), then the faster policy again with
`algorithm.off_policy_correction=tis`; see benchmarks/runner/colocated.py for what it reads off each run.

Each run is a separate `tandem train` process (its own services, a cold GPU for neither), so the two
see the same start-up. The table is read from each run's `metrics.jsonl`:
- mean step time, throughput (tokens/s) and mean staleness after `--warmup` steps;
- reward and ratio_abs ranges (min, max) after warm-up;
- val EM at the start (`runner.val_before_train`) and at the end (the last validation), overall and per
  data source (with each source's curve), and searches per trajectory per source: in validation (first
  and last) and in the trained rollouts (means over the first and last `--warmup` steps);
- the sync run's generation time G (the actor waiting for data: `time/wait_data`, else the step minus
  training and weight sync) and its training-plus-sync time T;
- overlap efficiency = max(G, T) / async mean step time: 1.0 means async hides the shorter side
  completely; above 1 it also gains from something else (e.g. no long tail per step).
Plots overlaying both runs are written next to the JSON (`tandem plot`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.runner.runs import (
    CONFIG_DIR,
    RESULTS,
    gpu_name,
    read_rows,
    run_train,
    summarize_run,
    write_result,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sync-config", default=str(CONFIG_DIR / "smollm2_h200_sync.yaml"))
    parser.add_argument("--async-config", default=str(CONFIG_DIR / "smollm2_h200_async.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="runner.max_steps of both runs")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the means and ranges")
    parser.add_argument("--runs-dir", default="runs/sync_vs_async")
    parser.add_argument("--only", choices=["sync", "async"], default=None, help="run one side only")
    parser.add_argument("--from-runs", nargs=2, metavar=("SYNC_RUN", "ASYNC_RUN"), default=None)
    parser.add_argument("--out", default=str(RESULTS / "sync_vs_async.json"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--colocated", action="store_true", help="sync + async per colocated policy + best tis"
    )
    parser.add_argument("--runs", default=None, help="--colocated: comma-separated subset of runs to run")
    parser.add_argument("--summarize-only", action="store_true", help="--colocated: read the runs, run none")
    parser.add_argument(
        "--gpu",
        help="--summarize-only: the device the runs ran on (default: this machine's, as for new runs)",
    )
    parser.add_argument("--monitor", action="store_true", help="sample CPU per role and nvidia-smi per run")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to both runs")
    return parser.parse_args()


def compare(sync: dict, asyn: dict) -> dict:
    generation, train_sync = sync["mean_generation_time_s"], sync["mean_train_and_sync_time_s"]
    overlap = None
    if generation is not None and train_sync is not None and asyn["mean_step_time_s"]:
        overlap = max(generation, train_sync) / asyn["mean_step_time_s"]
    ratio = asyn["mean_step_time_s"] / sync["mean_step_time_s"] if sync["mean_step_time_s"] else None
    return {"overlap_efficiency": overlap, "async_over_sync_step_time": ratio}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def print_table(result: dict) -> None:
    keys = [
        "mean_step_time_s",
        "throughput_tok_s",
        "mean_staleness",
        "reward_range",
        "ratio_abs_range",
        "val_em_start",
        "val_em_end",
        "mean_generation_time_s",
        "mean_train_and_sync_time_s",
    ]
    print(f"\n{'':32}{'sync':>24}{'async':>24}")
    for key in keys:
        print(f"{key:32}{_fmt(result['sync'].get(key)):>24}{_fmt(result['async'].get(key)):>24}")
    print(
        f"\nsteps {result['steps']} on {result['gpu']}: async / sync step time "
        f"{_fmt(result['async_over_sync_step_time'])}, overlap efficiency {_fmt(result['overlap_efficiency'])}"
    )


def main() -> int:
    args = parse_args()
    if args.colocated:
        from benchmarks.runner.colocated import run_colocated

        return run_colocated(args)
    runs = Path(args.runs_dir)
    sync_dir, async_dir = (
        (Path(p) for p in args.from_runs) if args.from_runs else (runs / "sync", runs / "async")
    )
    wall = {}
    if not args.from_runs:
        if args.only in (None, "sync"):
            wall["sync"] = run_train(args.sync_config, sync_dir, args.steps, args.overrides)
        if args.only in (None, "async"):
            wall["async"] = run_train(args.async_config, async_dir, args.steps, args.overrides)
        if args.only:
            return 0
    sync, asyn = (
        summarize_run(read_rows(sync_dir), args.warmup),
        summarize_run(read_rows(async_dir), args.warmup),
    )
    result = {
        "gpu": gpu_name(),
        "steps": min(sync["steps"], asyn["steps"]),
        "warmup_steps": args.warmup,
        **compare(sync, asyn),
        "sync": {**sync, "run_dir": str(sync_dir), "wall_s": wall.get("sync")},
        "async": {**asyn, "run_dir": str(async_dir), "wall_s": wall.get("async")},
        "command": " ".join(sys.argv),
    }
    print_table(result)
    write_result(result, Path(args.out), [(sync_dir, "sync"), (async_dir, "async")], args.no_plots)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
