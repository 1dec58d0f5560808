"""The sync-vs-async reference table: the same configuration run by both runners for the same steps.

    python benchmarks/sync_vs_async.py --steps 60 [--out benchmarks/results/sync_vs_async_h200.json]
        [--sync-config C] [--async-config C] [--runs-dir runs/sync_vs_async] [key=value ...]
    python benchmarks/sync_vs_async.py --from-runs SYNC_RUN_DIR ASYNC_RUN_DIR --out ...
    python benchmarks/sync_vs_async.py --colocated --steps 60 --monitor \
        --out benchmarks/results/colocated_h200.json      # sync, async per cluster.colocated_policy, best + tis

`--colocated` (one GPU shared by the actor and the engine): sync, then async under each
`cluster.colocated_policy` (time_share, concurrent), then the faster policy again with
`algorithm.off_policy_correction=tis`; see benchmarks/colocated.py for what it reads off each run.

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
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG_DIR = ROOT / "examples" / "searchr1" / "config"


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
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sync_vs_async.json"))
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


def run_train(
    config: str, output_dir: Path, steps: int | None, overrides: list[str], monitor: bool = False
) -> float:
    """One `tandem train` in its own process; returns its wall time. `monitor`: CPU per role and the
    GPU's utilization sampled into the run's directory meanwhile (benchmarks/run_monitor.py)."""
    from contextlib import nullcontext

    from benchmarks.run_monitor import RunMonitor

    command = [sys.executable, "-m", "tandemrl.cli", "train", config, f"runner.output_dir={output_dir}"]
    command += [f"runner.max_steps={steps}"] if steps else []
    command += overrides
    print("$", " ".join(command), flush=True)
    start_s = time.monotonic()
    with RunMonitor(output_dir) if monitor else nullcontext():
        subprocess.run(command, check=True, cwd=ROOT)
    return time.monotonic() - start_s


def read_rows(run_dir: Path) -> list[dict]:
    from tandemrl.metrics.logger import read_history

    rows = read_history(run_dir / "metrics.jsonl")
    if not rows:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'} holds no steps: did the run start?")
    return rows


def _values(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if key in row]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _range(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def generation_time(row: dict) -> float:
    """The part of a step the actor spent waiting for its batch (sync: the whole generation)."""
    if "time/wait_data" in row:
        return row["time/wait_data"]
    return row["time/step"] - row.get("time/train", 0.0) - row.get("time/sync_weights", 0.0)


def summarize_run(rows: list[dict], warmup: int) -> dict:
    steps = [row for row in rows if row["step"] >= 1]
    timed = [row for row in steps if row["step"] > warmup] or steps
    val = [(row["step"], row["val/em/all"]) for row in rows if "val/em/all" in row]
    summary = {
        "steps": len(steps),
        "mean_step_time_s": _mean(_values(timed, "time/step")),
        "throughput_tok_s": _mean(_values(timed, "throughput")),
        "mean_staleness": _mean(_values(timed, "rollout/data_staleness/mean")),
        "reward_range": _range(_values(timed, "rollout/reward/mean")),
        "ratio_abs_range": _range(_values(timed, "train/actor/ratio_abs")),
        "val_em_start": val[0][1] if val else None,
        "val_em_end": val[-1][1] if val else None,
        "val_em_curve": val,
        "mean_generation_time_s": _mean([generation_time(row) for row in timed]),
        "mean_train_and_sync_time_s": _mean(
            [row.get("time/train", 0.0) + row.get("time/sync_weights", 0.0) for row in timed]
        ),
    }
    for source in _sources(rows, "val/em/"):
        curve = [row[f"val/em/{source}"] for row in rows if f"val/em/{source}" in row]
        summary[f"val_em_{source}_start_end"] = [curve[0], curve[-1]]
    summary["val_em_curve_by_source"] = {
        source: [(row["step"], row[f"val/em/{source}"]) for row in rows if f"val/em/{source}" in row]
        for source in _sources(rows, "val/em/")
    }
    summary["val_num_searches_start_end"] = {  # per source and overall (all): first and last validation
        source: [values[0], values[-1]]
        for source in _sources(rows, "val/num_searches/")
        if (values := _values(rows, f"val/num_searches/{source}"))
    }
    window = max(1, warmup)  # train searches per source and overall (mean): first and last steps' mean
    summary["num_searches_start_end"] = {
        source: [_mean(values[:window]), _mean(values[-window:])]
        for source in _sources(steps, "rollout/num_searches/")
        if (values := _values(steps, f"rollout/num_searches/{source}"))
    }
    return summary


def _sources(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k.removeprefix(prefix) for row in rows for k in row if k.startswith(prefix)})


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the table is still worth writing without a GPU name
        return "unknown"


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
        from benchmarks.colocated import run_colocated

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


def write_result(result: dict, out: Path, runs: list[tuple[Path, str]], no_plots: bool) -> None:
    """The JSON at `out`, and (unless `no_plots`) the runs' overlays beside it in `<stem>_plots/`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not no_plots:
        write_plots(runs, out.parent / f"{out.stem}_plots")


def write_plots(runs: list[tuple[Path, str]], plot_dir: Path) -> None:
    """The overlays of `tandem plot` of (run directory, label) pairs."""
    from tandemrl.metrics.plots import load_run, overlay_runs

    overlay_runs([load_run(run_dir, label) for run_dir, label in runs], plot_dir)
    print(f"plots in {plot_dir}: " + ", ".join(sorted(p.name for p in plot_dir.glob("*.png"))))


if __name__ == "__main__":
    raise SystemExit(main())
