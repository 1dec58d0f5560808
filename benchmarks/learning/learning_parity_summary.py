"""The results of benchmarks/learning/learning_parity.py, read from each run's metrics.jsonl: per seed the curves
(val EM and val searches per source, train searches, reward and the per-source diagnostics per step), the
mean and sd over seeds of the start and end figures, the staleness-0 check, the issue's acceptance
figures; the plots with every seed and the mean band; a digest of trained trajectories.

Only runs that reached their last step count in the means, the check and the acceptance; a missing or
partial run leaves `complete` false and its figures None, never a made-up number.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 5  # steps averaged into the start / end figure of a per-step curve
OVERALL = {
    "val/em/": "all",
    "val/num_searches/": "all",
    "rollout/num_searches/": "mean",
    "rollout/reward/": "mean",
}
DIAGNOSTICS = ("search_advantage", "equal_reward_groups", "handoff_mix", "issued_mix")
KEY_FIGURES = ("val_em_start", "val_em_end", "kb_2hop_start", "kb_2hop_end", "ratio_abs_range", "realtext_em")
REALTEXT_SUMMARY = "realtext_eval/val_summary.json"  # learning_parity.py's evaluation of the final policy
SAMPLES_DIGEST = "samples_digest.json"  # a run's share of <stem>_samples.json, kept with it
MIN_VAL_EM_RISE = 0.15
MAX_FINAL_VAL_EM_GAP = 0.05
# versions: issue 35's three solo runs of the recipe trained at 1.92 on average over all steps, at most 4-5
SOLO_STALENESS_TOLERANCE = 0.25


def read_rows(run_dir: Path) -> list[dict]:
    from tandemrl.metrics.logger import read_history

    return read_history(run_dir / "metrics.jsonl")


def curve(rows: list[dict], key: str) -> list[list[float]]:
    return [[row["step"], row[key]] for row in rows if key in row]


def sources(rows: list[dict], prefix: str) -> list[str]:
    """The data sources logged under `prefix` (the overall series first)."""
    names = {key.removeprefix(prefix) for row in rows for key in row if key.startswith(prefix)}
    overall = OVERALL.get(prefix)
    rest = sorted(names - {overall})
    return ([overall] if overall in names else []) + rest


def curves(rows: list[dict], prefix: str) -> dict[str, list[list[float]]]:
    return {name: curve(rows, prefix + name) for name in sources(rows, prefix)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def read_realtext(run_dir: Path) -> dict[str, float | None]:
    """The final policy's real-text EM and searches (None where it was not evaluated)."""
    path = run_dir / REALTEXT_SUMMARY
    if not path.is_file():
        return {"realtext_em": None, "realtext_searches": None}
    overall = json.loads(path.read_text())["summary"]["overall"]
    return {"realtext_em": overall["em"], "realtext_searches": overall["searches"]}


def summarize_run(rows: list[dict], steps: int, check_steps: int) -> dict[str, Any]:
    """One run: its curves and figures (`figures`: the numbers the means, the check and the plots use)."""
    trained = [row for row in rows if row["step"] >= 1 and "time/step" in row]
    run = {
        "steps_done": len(trained),
        "complete": any(row["step"] == steps for row in trained),
        "val_em": curves(rows, "val/em/"),
        "val_num_searches": curves(rows, "val/num_searches/"),
        "num_searches": curves(trained, "rollout/num_searches/"),
        "reward": curves(trained, "rollout/reward/"),
        "diagnostics": {family: curves(trained, f"rollout/{family}/") for family in DIAGNOSTICS},
        "updates_per_step": _updates_per_step(trained),
    }
    figures: dict[str, float | None] = {}
    for name, points in run["val_em"].items():
        prefix = "val_em" if name == "all" else f"val_em_{name}"
        figures[f"{prefix}_start"], figures[f"{prefix}_end"] = points[0][1], points[-1][1]
    figures["kb_2hop_start"] = figures.get("val_em_kb_2hop_start")
    figures["kb_2hop_end"] = figures.get("val_em_kb_2hop_end")
    for name, points in run["num_searches"].items():
        values = [v for _, v in points]
        figures[f"num_searches_{name}_start"] = _mean(values[:WINDOW])
        figures[f"num_searches_{name}_end"] = _mean(values[-WINDOW:])
    figures["mean_staleness"] = _mean([row["rollout/data_staleness/mean"] for row in trained])
    maxima = [row["rollout/data_staleness/max"] for row in trained if "rollout/data_staleness/max" in row]
    figures["max_staleness"] = max(maxima) if maxima else None
    # the rollout-training gap the seed compares: |pi/pi_old - 1| per step, its spread over the run
    ratios = [row["train/actor/ratio_abs"] for row in trained if "train/actor/ratio_abs" in row]
    figures["ratio_abs_mean"] = _mean(ratios)
    figures["ratio_abs_max"] = max(ratios) if ratios else None
    figures["ratio_abs_range"] = max(ratios) - min(ratios) if ratios else None
    first = [row for row in trained if row["step"] <= check_steps]
    figures["first_steps_reward"] = _mean([row["rollout/reward/mean"] for row in first])
    figures["first_steps_num_searches"] = _mean([row["rollout/num_searches/mean"] for row in first])
    run["figures"] = figures
    return run


def _updates_per_step(trained: list[dict]) -> float | None:
    for row in trained:
        if "train/actor/num_updates" in row:
            return row["train/actor/num_updates"] / row["step"]
    return None


def aggregate(runs: dict[str, dict]) -> dict[str, Any]:
    """mean and sd (sample, over seeds) of every figure the complete runs all have."""
    complete = [run["figures"] for run in runs.values() if run["complete"]]
    keys = [k for k in (complete[0] if complete else {}) if all(f.get(k) is not None for f in complete)]
    mean = {k: statistics.fmean(f[k] for f in complete) for k in keys}
    sd = {k: statistics.stdev(f[k] for f in complete) if len(complete) > 1 else None for k in keys}
    for k in KEY_FIGURES:  # always present, None when unknown
        mean.setdefault(k, None)
        sd.setdefault(k, None)
    return {"num_seeds": len(complete), "mean": mean, "sd": sd}


CHECK_FIGURES = ("first_steps_reward", "first_steps_num_searches")


def staleness0_check(check: dict | None, sync_runs: dict[str, dict], check_steps: int) -> dict[str, Any]:
    """The check run's first-steps mean reward and searches against the sync seeds' range of the same."""
    done = [run["figures"] for run in sync_runs.values() if run["complete"]]
    result: dict[str, Any] = {"steps": check_steps, "num_sync_seeds": len(done), "passes": None}
    if check is None or not check["complete"] or not done:
        return {**result, "complete": False}
    result["complete"] = True
    is_inside = []
    for key in CHECK_FIGURES:
        low, high = min(f[key] for f in done), max(f[key] for f in done)
        value = check["figures"][key]
        result[key] = {"check": value, "sync_seeds_range": [low, high]}
        is_inside.append(low <= value <= high)
    result["mean_staleness"] = check["figures"]["mean_staleness"]
    result["passes"] = all(is_inside)
    return result


def check_over_seeds(checks: dict[str, dict], sync_runs: dict[str, dict]) -> dict[str, Any]:
    """The check's scatter over its seeds beside the sync seeds': per figure, mean and sd of each, and the
    check minus the sync run of the same seed (the same prompts in the same order, the same first policy)."""
    done = {seed: run["figures"] for seed, run in checks.items() if run["complete"]}
    sync = {seed: run["figures"] for seed, run in sync_runs.items() if run["complete"]}
    out: dict[str, Any] = {"check_seeds": sorted(done, key=int), "sync_seeds": sorted(sync, key=int)}
    for key in CHECK_FIGURES:
        values, sync_values = [f[key] for f in done.values()], [f[key] for f in sync.values()]
        out[key] = {
            "check_mean": _mean(values),
            "check_sd": statistics.stdev(values) if len(values) > 1 else None,
            "sync_mean": _mean(sync_values),
            "sync_sd": statistics.stdev(sync_values) if len(sync_values) > 1 else None,
            "check_minus_sync_same_seed": {s: f[key] - sync[s][key] for s, f in done.items() if s in sync},
        }
    return out


def staleness_vs_solo(result: dict[str, Any], solo_dirs: list[Path]) -> dict[str, Any]:
    """Whether the async seeds, run side by side on one GPU, trained on data as stale as the recipe does when it
    runs alone (`solo_dirs`: solo runs' directories with a metrics.jsonl, e.g. issue 35's timed runs). Sharing
    the GPU slows generation and training unequally, which could shift staleness and so what is compared.
    A seed matches when its mean staleness is within SOLO_STALENESS_TOLERANCE of the solo runs' range of means
    and its maximum is at most theirs."""
    solo = {}
    for run_dir in solo_dirs:
        figures = summarize_run(read_rows(run_dir), steps=0, check_steps=0)["figures"]
        label = str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir)
        solo[label] = {k: figures[k] for k in ("mean_staleness", "max_staleness")}
    out: dict[str, Any] = {"solo_runs": solo, "tolerance": SOLO_STALENESS_TOLERANCE, "matches": None}
    means = [s["mean_staleness"] for s in solo.values() if s["mean_staleness"] is not None]
    maxima = [s["max_staleness"] for s in solo.values() if s["max_staleness"] is not None]
    if not means or not maxima:
        return out
    low, high, top = min(means) - SOLO_STALENESS_TOLERANCE, max(means) + SOLO_STALENESS_TOLERANCE, max(maxima)
    verdicts = []
    for variant in ("async", "async_tis"):
        for seed, run in result.get(variant, {}).get("seeds", {}).items():
            if not run["complete"]:
                continue
            mean, most = run["figures"]["mean_staleness"], run["figures"]["max_staleness"]
            matches = mean is not None and most is not None and low <= mean <= high and most <= top
            out.setdefault(variant, {})[seed] = {
                "mean_staleness": mean,
                "max_staleness": most,
                "matches": matches,
            }
            verdicts.append(matches)
    out["matches"] = all(verdicts) if verdicts else None
    return out


def acceptance(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's acceptance, from the means over seeds. A value is shown from the seeds done so far, but
    decided (`passes` true or false) only once every planned seed of both modes is: `seeds_done` says
    how many are. None where a figure is missing."""
    out: dict[str, Any] = {}
    pair = ("sync", "async")
    done = {v: [result.get(v, {}).get("num_seeds", 0), len(result.get(v, {}).get("seeds", {}))] for v in pair}
    out["seeds_done"] = done

    def decide(value: float | None, passes: bool) -> bool | None:
        is_final = all(n == planned and planned > 0 for n, planned in done.values())
        return None if value is None or not is_final else passes

    for variant in pair:
        mean = result.get(variant, {}).get("mean", {})
        start, end = mean.get("val_em_start"), mean.get("val_em_end")
        rise = None if start is None or end is None else end - start
        out[f"{variant}_val_em_rise"] = {
            "value": rise,
            "passes": decide(rise, rise is not None and rise >= MIN_VAL_EM_RISE),
        }
        two_start, two_end = mean.get("kb_2hop_start"), mean.get("kb_2hop_end")
        two = None if None in (two_start, two_end) else two_end - two_start
        out[f"{variant}_kb_2hop_end_ge_start"] = {
            "value": two,
            "passes": decide(two, two is not None and two >= 0),
        }
    ends = [result.get(v, {}).get("mean", {}).get("val_em_end") for v in pair]
    gap = None if None in ends else abs(ends[1] - ends[0])
    out["final_val_em_gap"] = {
        "value": gap,
        "passes": decide(gap, gap is not None and gap <= MAX_FINAL_VAL_EM_GAP),
    }
    texts = [result.get(v, {}).get("mean", {}).get("realtext_em") for v in pair]
    text_gap = None if None in texts else abs(texts[1] - texts[0])
    out["final_realtext_em_gap"] = {
        "value": text_gap,
        "passes": decide(text_gap, text_gap is not None and text_gap <= MAX_FINAL_VAL_EM_GAP),
    }
    out["staleness0_check"] = result.get("staleness0_check", {}).get("passes")
    return out


def summarize(
    specs: list, runs_dir: Path, setup: dict[str, Any], solo_dirs: list[Path] | None = None
) -> dict[str, Any]:
    """The whole JSON: setup, one entry per variant (`seeds`, `mean`, `sd`), the check, the async seeds'
    staleness against solo runs', the acceptance."""
    check_steps = next((s.steps for s in specs if s.variant == "staleness0"), 10)
    result: dict[str, Any] = dict(setup)
    by_variant: dict[str, dict[str, dict]] = {}
    for spec in specs:
        run_dir = spec.run_dir(runs_dir)
        run = summarize_run(read_rows(run_dir), spec.steps, check_steps)
        run["figures"].update(read_realtext(run_dir))
        record = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
        run.update({key: record[key] for key in ("gpu", "imported_from") if key in record})
        by_variant.setdefault(spec.variant, {})[str(spec.seed)] = {"run_dir": str(run_dir), **run}
    checks = by_variant.pop("staleness0", {})  # in the order of --check-seeds: the first is decided on
    for variant, runs in by_variant.items():
        result[variant] = {"seeds": runs, **aggregate(runs)}
    sync = by_variant.get("sync", {})
    decided = next(iter(checks.values()), None)
    result["staleness0_check"] = staleness0_check(decided, sync, check_steps)
    if decided is not None:
        result["staleness0_check"]["run"] = decided
    if len(checks) > 1:  # further seeds describe the check's scatter; they decide nothing
        more = {}
        for seed, run in list(checks.items())[1:]:
            entry = staleness0_check(run, sync, check_steps)
            more[seed] = {"inside_sync_range": entry.pop("passes"), **entry, "run": run}
        result["staleness0_check"]["more_seeds"] = more
        result["staleness0_check"]["over_seeds"] = check_over_seeds(checks, sync)
    result["complete"] = all(
        run["complete"] for runs in [*by_variant.values(), checks] for run in runs.values()
    )
    result["staleness_vs_solo"] = staleness_vs_solo(result, solo_dirs or [])
    result["acceptance"] = acceptance(result)
    return result


# ------------------------------------------------------------------------------------------------ plots
COLOURS = {
    "sync": "tab:blue",
    "async": "tab:orange",
    "async_tis": "tab:green",
    "sync_finish_order": "tab:purple",
}


def write_plots(result: dict[str, Any], plot_dir: Path) -> list[Path]:
    """Val EM overall and per source, and train searches per source: every seed thin (dashed if cut
    short), the mean over the complete seeds bold, the band between their min and max; x = parameter
    updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    variants = [v for v in COLOURS if v in result]
    panels = {}
    for family, title in (("val_em", "Validation EM"), ("num_searches", "Searches per trajectory (train)")):
        names = sorted({n for v in variants for run in result[v]["seeds"].values() for n in run[family]})
        for name in names:
            panels[f"{family}_{name}"] = (family, name, f"{title}: {name}")
    paths = []
    for stem, (family, name, title) in panels.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant in variants:
            _band(ax, [run for run in result[variant]["seeds"].values()], family, name, variant)
        ax.set_title(title)
        ax.set_xlabel("parameter updates (step x n_minibatches)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = plot_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _band(ax, runs: list[dict], family: str, name: str, variant: str) -> None:
    colour = COLOURS[variant]
    series = []
    cut_short = 0
    for run in runs:
        points = run[family].get(name, [])
        if not points:
            continue
        scale = run["updates_per_step"] or 1.0
        xs, ys = [p[0] * scale for p in points], [p[1] for p in points]
        style = "-" if run["complete"] else "--"
        ax.plot(xs, ys, color=colour, alpha=0.35, linewidth=0.8, linestyle=style)
        if run["complete"]:
            series.append(dict(zip(xs, ys, strict=True)))
        else:
            cut_short += 1
    if not series:
        return
    xs = sorted(set.intersection(*(set(s) for s in series)))
    values = [[s[x] for s in series] for x in xs]
    ax.plot(
        xs,
        [statistics.fmean(v) for v in values],
        color=colour,
        linewidth=2,
        label=f"{variant} ({len(series)} seeds" + (f"; {cut_short} cut short, dashed)" if cut_short else ")"),
    )
    if len(series) > 1:
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.15)


# ------------------------------------------------------------------------------------- trajectory digest
def write_samples(
    specs: list, runs_dir: Path, path: Path, per_source: int = 2, max_chars: int = 1500
) -> Path:
    """Per run, at its first, middle and last step: per data source the histogram of searches, the
    mean reward per search count and a few transcripts (what was asked, searched and answered).
    Each run's digest is also kept in its directory (SAMPLES_DIGEST), which the runs bundle carries: a
    run imported from an earlier batch has no trajectories here, and keeps the digest made where it ran."""
    digest = {}
    for spec in specs:
        run_dir = spec.run_dir(runs_dir)
        steps = sorted({1, max(1, spec.steps // 2), spec.steps})
        per_step = {}
        for step in steps:
            file = run_dir / "trajectories" / f"step_{step}.jsonl"
            if file.is_file():
                rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
                per_step[str(step)] = _digest(rows, per_source, max_chars)
        kept = run_dir / SAMPLES_DIGEST
        if per_step:
            kept.write_text(json.dumps(per_step, indent=1) + "\n")
        elif kept.is_file():
            per_step = json.loads(kept.read_text())
        digest[f"{spec.variant}/seed{spec.seed}"] = per_step
    return write_json(path, digest, indent=1)


def _digest(rows: list[dict], per_source: int, max_chars: int) -> dict[str, Any]:
    out = {}
    for source in sorted({row["data_source"] for row in rows}):
        mine = [row for row in rows if row["data_source"] == source]
        by_searches: dict[int, list[float]] = {}
        for row in mine:
            by_searches.setdefault(len(row["searches"]), []).append(row["reward"])
        out[source] = {
            "num": len(mine),
            "searches_histogram": {str(n): len(r) for n, r in sorted(by_searches.items())},
            "reward_by_searches": {str(n): statistics.fmean(r) for n, r in sorted(by_searches.items())},
            "finish_reasons": {
                reason: sum(row["finish_reason"] == reason for row in mine)
                for reason in sorted({row["finish_reason"] for row in mine})
            },
            "samples": [
                {
                    "question": row["question"],
                    "golden_answers": row["golden_answers"],
                    "answer": row["answer"],
                    "reward": row["reward"],
                    "searches": row["searches"],
                    "transcript": row["response_text"][:max_chars],
                }
                for row in [r for r in mine if r.get("sample_index", 0) == 0][:per_source]  # one per group
            ],
        }
    return out
