"""What every runner benchmark does with a run: start `tandem train` in its own process, read its
metrics.jsonl back and summarize it, and write the result JSON with the runs' overlaid plots beside it.

sync_vs_async.py and colocated.py both import it; neither imports the other at module level (the
`--colocated` mode is reached from sync_vs_async.py's `main()`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "runner"
CONFIG_DIR = ROOT / "examples" / "searchr1" / "config"


WARM_CACHE_ENV = "TANDEM_BENCH_WARM_INDUCTOR_CACHE"
PROCESS_WALL_FILE = "process_wall.json"  # the whole `tandem train` process's wall time, start-up included


def run_env(output_dir: Path) -> dict[str, str]:
    """The run's environment: Inductor's cache (compiled graphs and, unless TRITON_CACHE_DIR is set, their
    kernels) in the run's own directory, emptied first, so no run loads what an earlier run of the job left
    (it is otherwise kept per machine: on the H200 in the fifth session the first run compiled cold inside its
    clock and the later ones loaded its cache, about 8 s of one side's wall; colocated_h200_compiled/COMMAND.md).
    With `TANDEM_BENCH_WARM_INDUCTOR_CACHE` set to a cache an untimed warm-up filled, every run starts from
    a fresh copy of that same snapshot, as a second run on any machine would, and compiles in its own clock
    only what the warm-up did not (benchmarks/runner/colocated_h200.sh, `warmup`)."""
    import os
    import shutil

    cache_dir = output_dir / "inductor_cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    warm = os.environ.get(WARM_CACHE_ENV)
    if warm:
        shutil.copytree(warm, cache_dir)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir.resolve())}


def run_train(
    config: str, output_dir: Path, steps: int | None, overrides: list[str], monitor: bool = False
) -> float:
    """One `tandem train` in its own process (`run_env`); returns its wall time, also written to the run's
    `process_wall.json` (PROCESS_WALL_FILE), so a later summary of runs made by other invocations has it.
    `monitor`: CPU per role and the GPU's utilization sampled into the run's directory meanwhile
    (benchmarks/runner/run_monitor.py)."""
    from contextlib import nullcontext

    from benchmarks.runner.run_monitor import RunMonitor

    command = [sys.executable, "-m", "tandemrl.cli", "train", config, f"runner.output_dir={output_dir}"]
    command += [f"runner.max_steps={steps}"] if steps else []
    command += overrides
    print("$", " ".join(command), flush=True)
    env = run_env(output_dir)
    start_s = time.monotonic()
    with RunMonitor(output_dir) if monitor else nullcontext():
        subprocess.run(command, check=True, cwd=ROOT, env=env)
    wall_s = time.monotonic() - start_s
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / PROCESS_WALL_FILE).write_text(json.dumps({"process_wall_s": wall_s}) + "\n")
    return wall_s


def process_wall(run_dir: Path) -> float | None:
    """The wall time of the `tandem train` process that made `run_dir` (`run_train`), None if unknown."""
    path = run_dir / PROCESS_WALL_FILE
    return json.loads(path.read_text())["process_wall_s"] if path.is_file() else None


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


def write_result(result: dict, out: Path, runs: list[tuple[Path, str]], no_plots: bool) -> None:
    """The JSON at `out`, and (unless `no_plots`) the runs' overlays beside it in `<stem>_plots/`."""
    write_json(out, result)
    if not no_plots:
        write_plots(runs, out.parent / f"{out.stem}_plots")


def write_plots(runs: list[tuple[Path, str]], plot_dir: Path) -> None:
    """The overlays of `tandem plot` of (run directory, label) pairs."""
    from tandemrl.metrics.plots import load_run, overlay_runs

    overlay_runs([load_run(run_dir, label) for run_dir, label in runs], plot_dir)
    print(f"plots in {plot_dir}: " + ", ".join(sorted(p.name for p in plot_dir.glob("*.png"))))
