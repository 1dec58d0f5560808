"""PNG plots of a run (reward, step time, staleness, buffer) from its `metrics.jsonl`.

Invariant: every plot's x-axis is "parameter updates" = rollout step x algorithm.n_minibatches
(SPEC §7), so sync and async runs with different batch layouts line up.
"""

from __future__ import annotations

from pathlib import Path

from tandemrl.metrics.logger import read_history

PLOTS = {  # file stem -> (title, y label, [(metric, legend)])
    "reward": (
        "Reward",
        "mean reward / EM",
        [("rollout/reward/mean", "train reward"), ("val/em/all", "val EM")],
    ),
    "step_time": ("Step time", "seconds", [("time/step", "step"), ("time/sync_weights", "weight sync")]),
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
        ],
    ),
}


def write_plots(output_dir: str | Path, n_minibatches: int, plot_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per entry of PLOTS next to the TensorBoard logs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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
