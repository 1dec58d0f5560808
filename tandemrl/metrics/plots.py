"""PNG plots of runs from their logs: one run's panels at the end of training (`write_plots`), and
`tandem plot RUN_DIR [RUN_DIR ...]`, which overlays several runs (`overlay_runs`).

Invariant: a "parameter updates" axis is rollout step x algorithm.n_minibatches, so sync and async
runs with different batch layouts line up (docs/DESIGN.md, Metrics); the overlay reads it from the actor's own count
(`train/actor/num_updates`) and falls back to step x n_minibatches from the run's `config.yaml`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tandemrl.config.errors import ConfigError
from tandemrl.host.files import InputFileError, check_directory, is_missing, read_text
from tandemrl.metrics.logger import read_history, read_tensorboard_scalars

PLOTS = {  # file stem -> (title, y label, [(metric, legend)])
    "reward": (
        "Reward",
        "mean reward / EM",
        [("rollout/reward/mean", "train reward"), ("val/em/all", "val EM")],
    ),
    "step_time": (
        "Step time",
        "seconds",
        [
            ("time/step", "step"),
            ("time/wait_data", "actor waits for data"),
            ("time/train", "train"),
            ("time/sync_weights", "weight sync"),
        ],
    ),
    "staleness": (
        "Off-policyness",
        "weight versions",
        [
            ("rollout/data_staleness/mean", "staleness"),
            ("rollout/version_span/mean", "version span"),
            ("rollout/queue_steps/mean", "queue steps"),
        ],
    ),
    "buffer": (
        "Rollout buffer",
        "groups / fraction",
        [
            ("rollout/buffer/inflight_groups", "in-flight groups"),
            ("rollout/buffer/size", "buffered groups"),
            ("rollout/buffer/dropped_groups", "dropped groups"),
            ("rollout/buffer/admission_wait_inflight_limit", "wait: in-flight limit (frac)"),
            ("rollout/buffer/admission_wait_buffer_full", "wait: buffer full (frac)"),
            ("rollout/buffer/admission_wait_staleness", "wait: staleness limit (frac)"),
        ],
    ),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def write_plots(output_dir: str | Path, n_minibatches: int, plot_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per entry of PLOTS next to the TensorBoard logs; returns their paths."""
    plt = _pyplot()
    output_dir = Path(output_dir)
    plot_dir = Path(plot_dir) if plot_dir is not None else output_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    history = read_history(output_dir / "metrics.jsonl")
    paths = []
    for stem, (title, ylabel, series) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for metric, label in series:
            points = [(row["step"] * n_minibatches, row[metric]) for row in history if metric in row]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel(f"parameter updates (step x n_minibatches={n_minibatches})")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        path = plot_dir / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- several runs overlaid
OVERLAYS = {  # file stem -> (title, y label, metric, x axis: step | wall_clock_s | updates)
    "step_time": ("Time per step", "seconds", "time/step", "step"),
    "reward_vs_time": (
        "Reward against wall-clock time",
        "mean train reward",
        "rollout/reward/mean",
        "wall_clock_s",
    ),
    "reward_vs_updates": (
        "Reward against parameter updates",
        "mean train reward",
        "rollout/reward/mean",
        "updates",
    ),
    "ratio_abs": ("|ratio - 1|", "train/actor/ratio_abs", "train/actor/ratio_abs", "updates"),
    "staleness": ("Data staleness", "weight versions", "rollout/data_staleness/mean", "updates"),
    "val_em": ("Validation EM", "EM (all sources)", "val/em/all", "updates"),
    "num_searches": (
        "Searches per trajectory",
        "searches (train rollouts)",
        "rollout/num_searches/mean",
        "updates",
    ),
}
# per data source s, one overlay each: (stem prefix, metric prefix, title, y label); the sources are those
# the runs logged (`rollout/num_searches/<s>`, `val/em/<s>`)
SOURCE_OVERLAYS = [
    ("val_em", "val/em/", "Validation EM", "EM"),
    ("val_num_searches", "val/num_searches/", "Validation searches per trajectory", "searches (greedy)"),
    ("num_searches", "rollout/num_searches/", "Searches per trajectory", "searches (train rollouts)"),
    ("reward", "rollout/reward/", "Train reward", "mean reward"),
]
SOURCE_EXCLUDED = {"all", "mean"}  # the overall series of those prefixes, plotted in OVERLAYS
X_LABELS = {
    "step": "rollout step",
    "wall_clock_s": "wall-clock seconds (sum of time/step)",
    "updates": "parameter updates (step x n_minibatches)",
}


@dataclass
class RunLog:
    label: str
    rows: list[dict[str, float]]  # one per rollout step, in step order
    n_minibatches: int | None  # from the run's config.yaml, when it has one

    def axis(self, name: str) -> list[float]:
        if name == "step":
            return [row["step"] for row in self.rows]
        if name == "wall_clock_s":
            total, out = 0.0, []
            for row in self.rows:
                total += row.get("time/step", 0.0)
                out.append(total)
            return out
        # a row without training (validation before the first step, at step 0) has made no update
        if all("train/actor/num_updates" in row for row in self.rows if row["step"] > 0):
            return [row.get("train/actor/num_updates", 0.0) for row in self.rows]
        if self.n_minibatches is None:
            raise ValueError(
                f"run {self.label!r}: no train/actor/num_updates in its metrics and no config.yaml with "
                "algorithm.n_minibatches, so its parameter updates are unknown. Add the run's config.yaml "
                "(`tandem config show CONFIG > RUN_DIR/config.yaml`)."
            )
        return [row["step"] * self.n_minibatches for row in self.rows]


def load_run(run_dir: str | Path, label: str | None = None, skipped: list[str] | None = None) -> RunLog:
    """A run's per-step metrics from `metrics.jsonl`, else from its TensorBoard event files. Bad input is
    an `InputFileError` naming the file and line; with `skipped`, an incomplete last line of a run still
    writing is skipped and described there."""
    run_dir = Path(run_dir)
    try:
        check_directory(run_dir, "run directory")
    except InputFileError as error:
        raise InputFileError(f"{str(error).rstrip('.')}; pass the runner.output_dir of a run.") from None
    rows = read_history(run_dir / "metrics.jsonl", skipped=skipped)
    if not rows:
        rows = _rows_from_tensorboard(run_dir)
    if not rows:
        jsonl = run_dir / "metrics.jsonl"
        what = "has no metrics.jsonl" if is_missing(jsonl) else f"its {str(jsonl)!r} holds no rows"
        raise InputFileError(
            f"run directory {str(run_dir)!r}: {what} and no TensorBoard event files; pass the "
            "runner.output_dir of a `tandem train` run that has logged a step."
        )
    return RunLog(label or run_dir.resolve().name, rows, _n_minibatches(run_dir / "config.yaml"))


def _rows_from_tensorboard(run_dir: Path) -> list[dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    try:
        scalars = read_tensorboard_scalars(run_dir)
    except Exception as error:  # tensorboard's parser on a file the user gave: any failure is bad input
        raise InputFileError(
            f"run directory {str(run_dir)!r}: its TensorBoard event files cannot be read ({error!r:.200})."
        ) from None
    for tag, points in scalars.items():
        for step, value in points:  # a resumed run logs a step again: the later value wins
            by_step.setdefault(step, {"step": step})[tag] = value
    return [by_step[step] for step in sorted(by_step)]


MAX_CONFIG_YAML_BYTES = 1 << 20  # as the config loader's bound


def _n_minibatches(config_path: Path) -> int | None:
    from tandemrl.config.loader import load_bounded_yaml

    if is_missing(config_path):
        return None
    where = f"run config {str(config_path)!r}"
    try:
        raw = load_bounded_yaml(read_text(config_path, "run config", MAX_CONFIG_YAML_BYTES), where)
    except ConfigError as error:
        raise InputFileError(str(error)) from None
    except Exception as error:  # a YAML syntax error, with its line
        raise InputFileError(f"{where} is not valid YAML: {' '.join(str(error).split())[:300]}") from None
    algorithm = raw.get("algorithm") if isinstance(raw, dict) else None
    value = algorithm.get("n_minibatches") if isinstance(algorithm, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputFileError(f"{where}: algorithm.n_minibatches is {value!r:.40}, not an integer >= 1.")
    return value


def run_labels(run_dirs: list[Path]) -> list[str]:
    """The run directories' names, with as many parent folders as it takes to tell them apart."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]


def source_overlays(runs: list[RunLog]) -> dict[str, tuple[str, str, str, str]]:
    """OVERLAYS-shaped entries for every data source the runs logged, per SOURCE_OVERLAYS family, e.g.
    `val_em_kb_2hop` for `val/em/kb_2hop`."""
    entries = {}
    for stem_prefix, metric_prefix, title, ylabel in SOURCE_OVERLAYS:
        sources = {
            key.removeprefix(metric_prefix)
            for run in runs
            for row in run.rows
            for key in row
            if key.startswith(metric_prefix)
        }
        for source in sorted(sources - SOURCE_EXCLUDED):
            stem = f"{stem_prefix}_{source}".replace("/", "_")
            entries[stem] = (f"{title}: {source}", ylabel, metric_prefix + source, "updates")
    return entries


def overlay_runs(runs: list[RunLog], out_dir: str | Path) -> dict[str, dict[str, tuple[list, list]]]:
    """One PNG per OVERLAYS entry, and per data source of SOURCE_OVERLAYS, with a line per run; returns
    stem -> run label -> (xs, ys) plotted."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plotted: dict[str, dict[str, tuple[list, list]]] = {}
    for stem, (title, ylabel, metric, x_name) in {**OVERLAYS, **source_overlays(runs)}.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        plotted[stem] = {}
        for run in runs:
            points = [
                (x, row[metric]) for x, row in zip(run.axis(x_name), run.rows, strict=True) if metric in row
            ]
            if points:
                xs, ys = (list(v) for v in zip(*points, strict=True))
                ax.plot(xs, ys, marker="o", markersize=3, label=run.label)
                plotted[stem][run.label] = (xs, ys)
        if not plotted[stem]:
            ax.text(0.5, 0.5, f"no run logged {metric}", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel(X_LABELS[x_name])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if plotted[stem]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=100)
        plt.close(fig)
    return plotted


def run_plot(args: argparse.Namespace) -> int:
    """`tandem plot RUN_DIR [RUN_DIR ...] [--out DIR]`."""
    run_dirs = [Path(d) for d in args.run_dirs]
    skipped: list[str] = []
    try:
        runs = [load_run(d, label, skipped) for d, label in zip(run_dirs, run_labels(run_dirs), strict=True)]
        for note in skipped:
            print(f"tandem plot: {note}", file=sys.stderr)
        plotted = overlay_runs(runs, args.out)
    except (
        ValueError,
        OSError,
        RuntimeError,
    ) as error:  # InputFileError is a ValueError; RuntimeError: a link loop
        print(f"tandem plot: {_one_line(error)}", file=sys.stderr)
        return 2
    print(f"tandem plot: {len(plotted)} plots of {len(runs)} run(s) in {args.out}: " + ", ".join(plotted))
    return 0


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:  # --out unwritable, a file, a full disk; a bad name
        return f"{error.filename!r}: {error.strerror}."
    return " ".join(str(error).split())
