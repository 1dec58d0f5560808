"""`benchmarks/runner/sync_vs_async.py --colocated`: sync against async on one GPU that the actor and the
engine share, under each `cluster.colocated_policy`, on the wall clock.

Runs (each its own `tandem train`, under `--runs-dir`): `sync`, `async_time_share`, `async_concurrent`,
`async_defaults` (the config's own colocated policy, `auto`), and any `async_<policy>_<label>` variant
(its overrides given on the command line), picked with `--runs`; a name ending in `_tis` adds the `tis`
correction. Every run directory under `--runs-dir` is summarized.

The clock is the wall clock (`clock: "wall"`, docs/DESIGN.md, The step clock): `time/step` covers
validation and checkpoints, and `wall_s` is the run's `time/wall` at its last step (the first step's start
to the last step's end); `validation_s` is how long its validations ran and `validation_wait_s` the part
of the clock that waited for them (less, where a validation ran beside the next step:
`runner.overlap_validation`). Read off each run's
metrics.jsonl after `--warmup` steps: `mean_step_time_s`, `throughput_tok_s`, `mean_staleness`,
`train_step_p50_s` / `train_step_p90_s` (`time/train`: the actor's train step as the runner waits for it),
`prefill_tokens_per_trajectory`, `val_em_start` / `val_em_end` and per source, where generation time went
(`rollout/engine_*`, `rollout/traj/*` means), the time to the first step (startup.json), and the stall
analysis: the actor's per-step probe (`perf/actor/*`, tandemrl/trainer/step_probe.py), what the engines ran
meanwhile, and, with `--monitor`, the CPU each role used during the train step, for the slow steps (train
above twice the sync run's median) against the others. Top level: `gpu`, `steps`, `best_async`
(`async_defaults`, the recipe as shipped, when it ran; else the async run with the least wall time),
`fastest_async` (the least wall time) and the issue's checks, read for `best_async` against sync.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.runner.runs import gpu_name, process_wall, read_rows, run_train, summarize_run, write_result

POLICIES = ("time_share", "concurrent")
PERF_KEYS = (
    "perf/actor/wait_gpu_s",
    "perf/actor/host_s",
    "perf/actor/cpu_s",
    "perf/actor/involuntary_switches",
    "perf/actor/gc_s",
    "perf/actor/alloc_retries",
    "perf/actor/device_allocs",
    "rollout/engine_steps_during_train",
    "rollout/engine_prefill_tokens_during_train",
    "rollout/engine_decode_tokens_during_train",
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default), q in [0, 1]."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def time_to_first_step(run_dir: Path) -> float | None:
    path = run_dir / "startup.json"
    return json.loads(path.read_text()).get("time_to_first_step_s") if path.is_file() else None


def train_windows(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (start, end) epoch seconds of its train step: the row is written after the weight sync and
    the bookkeeping, so the train step ended about time/sync_weights before it (validation rows left out)."""
    windows = {}
    for row in rows:
        if "wall_time" in row and "time/train" in row and "val/em/all" not in row:
            end = row["wall_time"] - row.get("time/sync_weights", 0.0)
            windows[row["step"]] = (end - row["time/train"], end)
    return windows


def cpu_during(run_dir: Path, window: tuple[float, float]) -> dict[str, float]:
    """Mean cores per role over the monitor's samples inside `window`."""
    path = run_dir / "cpu_by_role.jsonl"
    if not path.is_file():
        return {}
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    inside = [s for s in samples if window[0] <= s["wall_time"] <= window[1]]
    roles = sorted({k for s in inside for k in s if k != "wall_time"})  # load1 too: the machine's load
    return {role: sum(s.get(role, 0.0) for s in inside) / len(inside) for role in roles} if inside else {}


def stall_analysis(rows: list[dict], run_dir: Path, slow_above_s: float) -> dict:
    """The probe's means for slow train steps (time/train > slow_above_s) against the others."""
    windows = train_windows(rows)
    classes: dict[str, list[dict]] = {"slow": [], "fast": []}
    for row in rows:
        if "time/train" in row:
            classes["slow" if row["time/train"] > slow_above_s else "fast"].append(row)
    result: dict = {"slow_above_s": slow_above_s}
    for name, members in classes.items():
        summary = {"num_steps": len(members), "mean_train_s": _mean([r["time/train"] for r in members])}
        for key in PERF_KEYS:
            summary[key] = _mean([r[key] for r in members if key in r])
        cpu = [cpu_during(run_dir, windows[r["step"]]) for r in members if r["step"] in windows]
        cpu = [c for c in cpu if c]
        roles = sorted({role for c in cpu for role in c})
        summary["cpu_cores_during_train"] = {role: _mean([c.get(role, 0.0) for c in cpu]) for role in roles}
        result[name] = summary
    return result


def profiled_steps(run_dir: Path) -> set[int]:
    """runner.profile_steps of the run (its config.yaml): left out of the means, the profiler slows them."""
    import yaml

    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else None
    return set(((config or {}).get("runner") or {}).get("profile_steps") or [])


GENERATION_KEYS = (  # where generation time went: means over the timed steps
    "rollout/engine_busy_fraction",
    "rollout/engine_steps",
    "rollout/engine_prefill_steps",
    "rollout/engine_decode_batch_mean",
    "rollout/engine_decode_step_ms",
    "rollout/engine_prefill_step_ms",
    "rollout/traj/wall_s",
    "rollout/traj/generate_s",
    "rollout/traj/server_s",
    "rollout/traj/http_s",
    "rollout/traj/search_s",
    "rollout/traj/agent_s",
    "rollout/buffer/admission_wait_buffer_full",
    "rollout/buffer/admission_wait_inflight_limit",
    "rollout/buffer/admission_wait_staleness",
    "rollout/buffer/inflight_groups",
    "rollout/response_length",
    "rollout/num_searches/mean",
    "time/wait_data",
    "time/stand_down",
    "time/samples",
    "time/engine_reads",
    "time/sync_weights",
    "time/other",
    "driver/loop_late_s",
    "driver/loop_max_late_ms",
    "driver/loop_stalled_s",
    "rollout/engine_http_loop_late_s",
    "rollout/engine_http_loop_stalled_s",
)


def loop_stall_sites(run_dir: Path, top: int = 10) -> dict[str, float]:
    """What held the driver's event loop over the whole run: seconds per code location, summed over the
    lines of its loop_stalls.jsonl (tandemrl/host/loop_monitor.py), the `top` largest."""
    path = run_dir / "loop_stalls.jsonl"
    totals: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            for where, seconds in json.loads(line)["where"].items():
                totals[where] = totals.get(where, 0.0) + seconds
    return dict(sorted(totals.items(), key=lambda item: -item[1])[:top])


def summarize(run_dir: Path, warmup: int, slow_above_s: float | None) -> dict:
    profiled = profiled_steps(run_dir)
    rows = [row for row in read_rows(run_dir) if row["step"] not in profiled]
    summary = summarize_run(rows, warmup)
    summary["profiled_steps_left_out"] = sorted(profiled)
    trained = [row for row in rows if "time/train" in row]
    timed = [row for row in trained if row["step"] > warmup] or trained  # as summarize_run does
    train = [row["time/train"] for row in timed]
    actor = [row["time/train_step"] for row in timed if "time/train_step" in row]
    per_trajectory = {
        f"engine_{kind}_tokens_per_trajectory": _mean(
            [
                r[f"rollout/engine_{kind}_tokens"] / r["rollout/total_num_sequence"]
                for r in timed
                if f"rollout/engine_{kind}_tokens" in r
            ]
        )
        for kind in ("prefill", "decode")
    }
    summary.update(
        {
            **per_trajectory,
            "train_step_p50_s": percentile(train, 0.5),
            "train_step_p90_s": percentile(train, 0.9),
            "actor_train_step_p50_s": percentile(actor, 0.5),
            "actor_train_step_p90_s": percentile(actor, 0.9),
            "time_to_first_step_s": time_to_first_step(run_dir),
            "run_dir": str(run_dir),
            "process_wall_s": process_wall(run_dir),  # the whole `tandem train`, start-up included
            "wall_s": next((r["time/wall"] for r in reversed(rows) if "time/wall" in r), None),
            # how long the validations ran (one beside the next step included), and how much of the
            # clock waited for them (runner.overlap_validation: only the part the next step did not cover)
            "validation_s": sum(
                r.get("time/validation", 0.0) + r.get("time/validation_overlapped", 0.0) for r in rows
            ),
            "validation_wait_s": sum(
                r.get("time/validation", 0.0) + r.get("time/wait_validation", 0.0) for r in rows
            ),
            "checkpoint_s": sum(r.get("time/checkpoint", 0.0) for r in rows),
            "mean_step_time_all_steps_s": _mean([r["time/step"] for r in trained if "time/step" in r]),
            "prefill_tokens_per_trajectory": per_trajectory["engine_prefill_tokens_per_trajectory"],
            "generation": {key: _mean([r[key] for r in timed if key in r]) for key in GENERATION_KEYS},
            "loop_stall_sites": loop_stall_sites(run_dir),
        }
    )
    if slow_above_s is not None:
        summary["stall_analysis"] = stall_analysis(timed, run_dir, slow_above_s)
    return summary


def common_stretch(run_dirs: dict[str, Path], warmup: int) -> dict:
    """Every run's wall time over the same steps: those after the warm-up that all runs finished, less
    each run's profiled steps and the step after each (it finds the buffer the long profiled step let
    async fill). The fair clock when a run stopped early or profiled some steps."""
    step_times: dict[str, dict[int, float]] = {}
    left_out: set[int] = set()
    for name, run_dir in run_dirs.items():
        step_times[name] = {r["step"]: r["time/step"] for r in read_rows(run_dir) if "time/step" in r}
        left_out |= {n + k for n in profiled_steps(run_dir) for k in (0, 1)}
    common = set.intersection(*(set(times) for times in step_times.values())) if step_times else set()
    steps = sorted(n for n in common if n > warmup and n not in left_out)
    wall = {name: sum(times[n] for n in steps) for name, times in step_times.items()}
    sync_wall = wall.get("sync")
    return {
        "steps": steps,
        "wall_s": wall,
        "wall_over_sync": {n: w / sync_wall for n, w in wall.items() if n != "sync"} if sync_wall else {},
    }


def checks(sync: dict, best: dict) -> dict:
    """The issue's acceptance, read from the two runs' summaries."""

    def ratio(key: str) -> float | None:
        return best[key] / sync[key] if best.get(key) and sync.get(key) else None

    def val_gap(source: str) -> tuple[float | None, int | None]:
        """best - sync at the last validation both ran (a run that stopped early validated less)."""
        curves = [
            dict(map(tuple, run.get("val_em_curve_by_source", {}).get(source, []))) for run in (sync, best)
        ]
        common = set(curves[0]) & set(curves[1])
        if not common:
            return None, None
        step = max(common)
        return curves[1][step] - curves[0][step], step

    val_em_gap, val_step = val_gap("all")
    result = {
        "wall_over_sync": ratio("wall_s"),
        # start-up included (the actor's compile among it, trainer/actor.py warm_up): beside the clock
        "process_wall_over_sync": ratio("process_wall_s"),
        "best_async_over_sync": ratio("mean_step_time_s"),
        "throughput_over_sync": ratio("throughput_tok_s"),
        "train_step_p90_over_sync": ratio("train_step_p90_s"),
        "val_em_end_minus_sync": val_em_gap,
        "kb_2hop_end_minus_sync": val_gap("kb_2hop")[0],
        "val_compared_at_step": val_step,
    }
    bars = {
        "wall_at_most_0.7_sync": ("wall_over_sync", lambda v: v <= 0.7),
        "step_time_at_most_0.7_sync": ("best_async_over_sync", lambda v: v <= 0.7),
        "throughput_at_least_1.4_sync": ("throughput_over_sync", lambda v: v >= 1.4),
        "train_p90_at_most_1.5_sync": ("train_step_p90_over_sync", lambda v: v <= 1.5),
        "val_em_end_at_least_sync_minus_0.05": ("val_em_end_minus_sync", lambda v: v >= -0.05),
        "kb_2hop_end_at_least_sync_minus_0.05": ("kb_2hop_end_minus_sync", lambda v: v >= -0.05),
    }
    for name, (key, holds) in bars.items():
        result[name] = result[key] is not None and holds(result[key])
    return result


def run_plan(name: str, args) -> tuple[str, list[str]]:
    """The config and overrides of a named run: sync[_<label>], async_defaults, async_<policy>[_<label>][_tis]
    (a label's overrides come from the command line; ratios are always against the run named `sync`)."""
    if name == "sync" or name.startswith("sync_"):
        return args.sync_config, []
    extra = ["algorithm.off_policy_correction=tis"] if name.endswith("_tis") else []
    policy = next((p for p in POLICIES if name.startswith(f"async_{p}")), None)
    if policy is None and not name.startswith("async_defaults"):
        raise SystemExit(
            f"--runs: {name!r} is not sync[_label], async_defaults or async_<{'|'.join(POLICIES)}>[_label]"
        )
    return args.async_config, ([f"cluster.colocated_policy={policy}"] if policy else []) + extra


def run_colocated(args) -> int:
    runs_dir = Path(args.runs_dir)
    wanted = args.runs.split(",") if args.runs else ["sync", *(f"async_{p}" for p in POLICIES)]
    if not args.summarize_only:
        for name in wanted:
            config, extra = run_plan(name, args)
            run_train(config, runs_dir / name, args.steps, args.overrides + extra, args.monitor)
    if not (runs_dir / "sync" / "metrics.jsonl").is_file():
        print(f"no sync run in {runs_dir} yet")
        return 0
    sync = summarize(runs_dir / "sync", args.warmup, None)
    slow_above_s = 2.0 * sync["train_step_p50_s"]
    runs = {"sync": sync}
    variants = [*runs_dir.glob("sync_*/metrics.jsonl"), *runs_dir.glob("async_*/metrics.jsonl")]
    for run_dir in sorted(p.parent for p in variants):
        runs[run_dir.name] = summarize(run_dir, args.warmup, slow_above_s)
    async_runs = [name for name in runs if name.startswith("async_")]
    if not async_runs:  # a part of the benchmark run on its own (benchmarks/runner/colocated_h200.sh)
        print(f"only sync in {runs_dir} so far: {sync['mean_step_time_s']} s per step")
        return 0
    fastest = min(async_runs, key=lambda name: runs[name]["wall_s"] or float("inf"))
    # the "best of them with your defaults": the run of the recipe as shipped, when it ran
    best = "async_defaults" if "async_defaults" in runs else fastest
    result = {
        "clock": "wall",
        "gpu": args.gpu or gpu_name(),
        "steps": min(run["steps"] for run in runs.values()),
        "warmup_steps": args.warmup,
        "best_async": best,
        "fastest_async": fastest,
        **checks(sync, runs[best]),
        "common_stretch": common_stretch({name: runs_dir / name for name in runs}, args.warmup),
        "runs": runs,
        "command": " ".join(sys.argv),
    }
    print_table(result)
    write_result(result, Path(args.out), [(runs_dir / name, name) for name in runs], args.no_plots)
    return 0


def print_table(result: dict) -> None:
    keys = (
        "wall_s",
        "validation_s",
        "validation_wait_s",
        "mean_step_time_s",
        "throughput_tok_s",
        "mean_staleness",
        "train_step_p50_s",
        "train_step_p90_s",
        "prefill_tokens_per_trajectory",
        "val_em_start",
        "val_em_end",
        "time_to_first_step_s",
        "process_wall_s",
    )
    names = list(result["runs"])
    print("\n" + f"{'':24}" + "".join(f"{name:>22}" for name in names))
    for key in keys:
        cells = "".join(f"{_fmt(result['runs'][name].get(key)):>22}" for name in names)
        print(f"{key:24}{cells}")
    print(
        f"\n{result['steps']} steps on {result['gpu']} (wall clock): best async {result['best_async']}, "
        f"wall {_fmt(result['wall_over_sync'])} x sync, step time {_fmt(result['best_async_over_sync'])} x sync, "
        f"throughput {_fmt(result['throughput_over_sync'])} x sync, train p90 "
        f"{_fmt(result['train_step_p90_over_sync'])} x sync, val EM end {_fmt(result['val_em_end_minus_sync'])} "
        "against sync"
    )


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
