"""Where the second search goes, across the 40-step colocated runs already made (no new run):

    python -m benchmarks.learning.search_drift [--runs-glob 'benchmarks/results/runner/colocated_h[12]00*/*']
        [--first 1 10] [--last 26 40] [--out benchmarks/results/learning/search_drift_h100_h200.json]

For each run directory with a metrics.jsonl of at least `--last`'s end steps and its config.yaml: the mode and
the keys that set staleness (runner.async_mode, cluster.colocated_policy, the staleness bound, the correction,
the proximal policy, the hand-off order, the engine's prefix-cache age); the mean over the first and the last
window of `rollout/num_searches/kb_2hop` and `rollout/reward/kb_2hop`; the mean of
`rollout/search_advantage/kb_1hop` over the run (the advantages' push on the number of searches in 1-hop
groups: negative means more searches scored lower); the share of the engine's prefix-cache hits served from
K/V an older weight version computed (`rollout/engine_stale_prefix_hit_tokens` over
`rollout/engine_prefix_hit_tokens`, from step 4); and the final kb_2hop val EM. Then, per mode, the mean and
range of each, so the question "does async drift toward one search more than sync, and with what?" is read
from every run at once rather than one pair (docs/LEARNING.md, Learning parity across seeds).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

import yaml

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
SEARCHES, REWARD, ADVANTAGE = (
    "rollout/num_searches/kb_2hop",
    "rollout/reward/kb_2hop",
    "rollout/search_advantage/kb_1hop",
)
STALE_HITS, HITS = "rollout/engine_stale_prefix_hit_tokens", "rollout/engine_prefix_hit_tokens"
FIRST_MEASURED_STEP = 4  # the warm steps before are left out of every run's means (sync_vs_async.py)
PER_RUN = ("searches_2hop_first", "searches_2hop_last", "reward_2hop_last", "search_advantage_1hop")


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _window(rows: list[dict], key: str, lo: int, hi: int) -> float | None:
    return _mean([row[key] for row in rows if lo <= row["step"] <= hi and row.get(key) is not None])


def _get(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def read_run(run_dir: Path, first: tuple[int, int], last: tuple[int, int]) -> dict | None:
    """One run's figures, or None when it has no config or stops before the last window's end."""
    metrics, config_path = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not config_path.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [row for row in rows if SEARCHES in row]
    if not train or max(row["step"] for row in train) < last[1]:
        return None
    config = yaml.safe_load(config_path.read_text()) or {}
    measured = [row for row in train if row["step"] >= FIRST_MEASURED_STEP]
    hits = sum(row.get(HITS) or 0 for row in measured)
    stale = sum(row.get(STALE_HITS) or 0 for row in measured)
    has_stale = any(STALE_HITS in row for row in measured)
    val = [row for row in rows if row.get("val/em/kb_2hop") is not None]
    return {
        "run": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "mode": "async" if _get(config, "runner.async_mode") else "sync",
        "config": {
            key: _get(config, key)
            for key in (
                "cluster.colocated_policy",
                "rollout_buffer.max_head_offpolicyness",
                "algorithm.off_policy_correction",
                "algorithm.proximal_logprobs",
                "rollout_buffer.handoff_order",
                "rollout.pause_mode",
                "rollout.engine.prefix_cache_max_age",
            )
        },
        "searches_2hop_first": _window(train, SEARCHES, *first),
        "searches_2hop_last": _window(train, SEARCHES, *last),
        "reward_2hop_last": _window(train, REWARD, *last),
        "search_advantage_1hop": _window(train, ADVANTAGE, 1, last[1]),
        "stale_prefix_hit_share": stale / hits if has_stale and hits else None,
        "val_kb_2hop_end": max(val, key=lambda row: row["step"])["val/em/kb_2hop"] if val else None,
    }


def summarize(runs: list[dict]) -> dict:
    """Per mode: the number of runs, and each per-run figure's mean, min and max."""
    by_mode: dict[str, dict] = {}
    for mode in ("sync", "async"):
        mine = [run for run in runs if run["mode"] == mode]
        figures = {}
        for key in (*PER_RUN, "stale_prefix_hit_share", "val_kb_2hop_end"):
            values = [run[key] for run in mine if run[key] is not None]
            figures[key] = (
                {
                    "mean": statistics.fmean(values),
                    "min": min(values),
                    "max": max(values),
                    "runs": len(values),
                }
                if values
                else None
            )
        falling = [run for run in mine if run["searches_2hop_last"] < run["searches_2hop_first"]]
        by_mode[mode] = {
            "runs": len(mine),
            "runs_whose_2hop_searches_fell": len(falling),
            **figures,
        }
    return by_mode


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-glob", default=str(ROOT / "benchmarks/results/runner/colocated_h[12]00*/*"))
    parser.add_argument("--first", type=int, nargs=2, default=(1, 10), metavar=("FROM", "TO"))
    parser.add_argument("--last", type=int, nargs=2, default=(26, 40), metavar=("FROM", "TO"))
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/learning/search_drift_h100_h200.json")
    )
    args = parser.parse_args(argv)
    runs = [
        run
        for path in sorted(glob.glob(args.runs_glob))
        if (run := read_run(Path(path), tuple(args.first), tuple(args.last))) is not None
    ]
    if not runs:
        raise SystemExit(f"no run under {args.runs_glob} reaches step {args.last[1]} with a config.yaml")
    result = {"windows": {"first": list(args.first), "last": list(args.last)}, "by_mode": summarize(runs)}
    result["runs"] = runs
    for mode, figures in result["by_mode"].items():
        advantage = figures["search_advantage_1hop"]
        print(
            f"{mode}: {figures['runs']} runs, kb_2hop searches fell in {figures['runs_whose_2hop_searches_fell']}; "
            f"kb_1hop search advantage mean {advantage['mean']:+.3f} ({advantage['min']:+.3f} to {advantage['max']:+.3f})"
            if advantage
            else f"{mode}: {figures['runs']} runs"
        )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
