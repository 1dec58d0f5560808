"""n-gram speculative decoding on the H200 recipe (issue 39): the sync recipe run twice, without and with
`rollout.engine.speculative=ngram`, same seed, same steps, each its own `tandem train` on the wall clock
(benchmarks/runner/runs.py: validation inside the clock, each run compiling in its own clock).

    python -m benchmarks.engine.speculative_h200 --runs-dir RUNS [--steps 20] [--spec key=value ...] [key=value ...]

`--spec` overrides go to the `with` run only (e.g. rollout.engine.spec_num_draft_tokens=6); the trailing
overrides to both. `--summarize-only` reads RUNS/without and RUNS/with as they are. The JSON
(`benchmarks/results/engine/speculative_h200.json` by default) holds `with` and `without`, each with
`acceptance_rate`, `tokens_per_step` (tokens a request's decode or verify step emits), `decode_steps_per_token`
(decode or verify rows over emitted tokens: about 1 without speculation, a little above it where
overlapped steps scheduled a row for a request that had just stopped, 1.025 in the sync recipe), `decode_steps_per_trajectory`,
`wait_data_s` (a step's generation time, `runs.generation_time`), `mean_step_time_s`, `wall_s`,
`val_em_start` and `val_em_end`; and the issue's checks: generation time per step <= 0.75 x without,
decode steps per emitted token <= 0.7, final val EM within 0.03 of the run without. Means are over the
steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.runner.runs import (
    CONFIG_DIR,
    ROOT,
    gpu_name,
    process_wall,
    read_rows,
    run_train,
    summarize_run,
    write_result,
)

RUNS = ("without", "with")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spec_summary(rows: list[dict], warmup: int) -> dict:
    """The speculation figures of one run's metrics rows (tandemrl/runner/step_metrics.py `spec_metrics`),
    over the steps after `warmup`: token-weighted, so a step with more decode rows counts for more."""
    base = summarize_run(rows, warmup)
    timed = [r for r in rows if r["step"] > warmup and "rollout/engine_decode_rows" in r]
    num_rows = sum(r["rollout/engine_decode_rows"] for r in timed)
    emitted = sum(r["rollout/engine_decode_rows"] * r["rollout/spec/tokens_per_step"] for r in timed)
    rates = [r["rollout/spec/acceptance_rate"] for r in timed if "rollout/spec/acceptance_rate" in r]
    per_traj = [
        r["rollout/spec/decode_steps_per_trajectory"]
        for r in timed
        if "rollout/spec/decode_steps_per_trajectory" in r
    ]
    wall = next((r["time/wall"] for r in reversed(rows) if "time/wall" in r), None)
    return {
        "steps": base["steps"],
        "acceptance_rate": _mean(rates),
        "tokens_per_step": emitted / num_rows if num_rows else None,
        "decode_steps_per_token": num_rows / emitted if emitted else None,
        "decode_steps_per_trajectory": _mean(per_traj),
        "wait_data_s": base["mean_generation_time_s"],
        "mean_step_time_s": base["mean_step_time_s"],
        "wall_s": wall,
        "throughput_tok_s": base["throughput_tok_s"],
        "val_em_start": base["val_em_start"],
        "val_em_end": base["val_em_end"],
        "val_em_curve": base["val_em_curve"],
        "val_em_curve_by_source": base["val_em_curve_by_source"],
    }


def checks(without: dict, spec: dict) -> dict:
    """Issue 39's acceptance, read from the two summaries (None where a figure is missing)."""

    def ratio(key: str) -> float | None:
        return spec[key] / without[key] if spec.get(key) and without.get(key) else None

    em_gap = (
        spec["val_em_end"] - without["val_em_end"]
        if spec.get("val_em_end") is not None and without.get("val_em_end") is not None
        else None
    )
    result = {
        "wait_data_with_over_without": ratio("wait_data_s"),
        "step_time_with_over_without": ratio("mean_step_time_s"),
        "wall_with_over_without": ratio("wall_s"),
        "val_em_end_with_minus_without": em_gap,
    }
    steps = spec.get("decode_steps_per_token")
    result["generation_at_most_0.75_without"] = result["wait_data_with_over_without"] is not None and (
        result["wait_data_with_over_without"] <= 0.75
    )
    result["decode_steps_per_token_at_most_0.7"] = steps is not None and steps <= 0.7
    result["val_em_end_within_0.03"] = em_gap is not None and abs(em_gap) <= 0.03
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(CONFIG_DIR / "smollm2_h200_sync.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the means")
    parser.add_argument("--runs-dir", default="runs/speculative")
    parser.add_argument(
        "--spec", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the `with` run"
    )
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--monitor", action="store_true", help="CPU and GPU monitors in each run's directory")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/engine/speculative_<gpu>.json"
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of both runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs_dir = Path(args.runs_dir)
    plan = {
        "without": args.overrides,
        "with": [*args.overrides, "rollout.engine.speculative=ngram", *args.spec],
    }
    if not args.summarize_only:
        for name in RUNS:
            run_train(args.config, runs_dir / name, args.steps, plan[name], args.monitor)
    summaries = {name: spec_summary(read_rows(runs_dir / name), args.warmup) for name in RUNS}
    for name in RUNS:
        summaries[name]["process_wall_s"] = process_wall(runs_dir / name)
    gpu = gpu_name()
    result = {
        "clock": "wall",
        "gpu": gpu,
        "config": args.config,
        "steps": min(s["steps"] for s in summaries.values()),
        "warmup_steps": args.warmup,
        **summaries,
        "checks": checks(summaries["without"], summaries["with"]),
        "overrides": plan,
        "command": " ".join(sys.argv),
    }
    default_name = "speculative_h200.json" if "H200" in gpu else "speculative_cpu.json"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "engine" / default_name
    for key in (
        "acceptance_rate",
        "tokens_per_step",
        "decode_steps_per_token",
        "wait_data_s",
        "mean_step_time_s",
        "wall_s",
        "val_em_start",
        "val_em_end",
    ):
        print(f"{key:28}" + "".join(f"{_fmt(summaries[name][key]):>14}" for name in RUNS))
    print(f"checks: {result['checks']}")
    write_result(result, out, [(runs_dir / name, name) for name in RUNS], args.no_plots)
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
