"""Per-step metrics: the experiment trackers (TensorBoard by default, wandb, mlflow: metrics/trackers.py),
a `metrics.jsonl` history, one console line and a progress bar.

Invariant: the TensorBoard step of every scalar is the rollout step (hand-off); plots convert it to
"parameter updates" (step x algorithm.n_minibatches, docs/DESIGN.md, Metrics) from `metrics.jsonl`, which holds the
same numbers as the event files. The console line names the step's bottleneck (`bottleneck`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.config.schema import MetricsConfig
    from tandemrl.metrics.trackers import Tracker

log = logging.getLogger(__name__)

CONSOLE_FIELDS = (  # (metric, label, format)
    ("rollout/reward/mean", "reward", "{:.3f}"),
    ("rollout/data_staleness/mean", "staleness", "{:.2f}"),
    ("time/step", "step_s", "{:.1f}"),
    ("throughput", "tok/s", "{:.0f}"),
    ("rollout/buffer/dropped_groups", "dropped", "{:.0f}"),
    ("time/wait_data", "wait_s", "{:.1f}"),
    ("time/train", "train_s", "{:.1f}"),
    ("time/sync_weights", "sync_s", "{:.1f}"),
    ("rollout/engine_busy_fraction", "engine_busy", "{:.2f}"),
)
# Share of the step the actor may wait for data before the rollout is named the bottleneck. Async: the
# engines should always be ahead, so any real wait means generation is too slow. Sync: the two sides
# take turns, so the rollout limits the step when generating takes more than all the rest.
BOTTLENECK_WAIT_SHARE = {True: 0.1, False: 0.5}  # runner.async_mode -> share


class MetricsLogger:
    """Writes each step's metrics to every tracker (`<output_dir>/tensorboard` by default) and to
    `<output_dir>/metrics.jsonl`. `metrics_cfg` (the config's `metrics` section) names the trackers;
    `config` (the resolved config as a dict) is attached to each."""

    def __init__(
        self,
        output_dir: str | Path,
        max_steps: int,
        start_step: int = 0,
        show_progress: bool = True,
        is_async: bool = False,
        metrics_cfg: MetricsConfig | None = None,
        config: dict | None = None,
    ):
        from tqdm import tqdm

        from tandemrl.metrics.trackers import start_trackers

        self.output_dir = Path(output_dir)
        self.is_async = is_async
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.tensorboard_dir = self.output_dir / "tensorboard"
        names = list(metrics_cfg.trackers) if metrics_cfg is not None else ["tensorboard"]
        self.trackers = start_trackers(names, metrics_cfg, self.output_dir, config, self.tensorboard_dir)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self._bar = tqdm(
            total=max_steps,
            initial=start_step,
            desc="steps",
            unit="step",
            disable=not show_progress,
            dynamic_ncols=True,
        )

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Record `metrics` at `step`; `advance=False` for rows that are not a step (validation before
        the first one)."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.jsonl_path.open("a") as f:  # wall_time (epoch s), as TensorBoard stamps its events
            f.write(json.dumps({"step": step, "wall_time": time.time(), **clean}) + "\n")
        self._bar.write(console_line(step, self._bar.total, clean, self.is_async))
        if advance:
            self._bar.update(1)
        for tracker in list(self.trackers):
            try:
                tracker.log(step, clean)
            except Exception as error:  # a dashboard lost, never the run: metrics.jsonl has every number
                self._drop(tracker, f"logging step {step} failed", error)

    def close(self) -> None:
        self._bar.close()
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as error:
                self._drop(tracker, "closing failed", error)

    def _drop(self, tracker: Tracker, what: str, error: BaseException) -> None:
        from tandemrl.host.messages import one_line

        self.trackers.remove(tracker)
        log.warning(
            "metrics.trackers: %s %s (%s); it gets no more metrics in this run, which goes on "
            "(every metric is also in %s).",
            tracker.name,
            what,
            one_line(error),
            self.jsonl_path,
        )


def bottleneck(metrics: dict[str, float], is_async: bool) -> str | None:
    """'rollout' when the actor waited for data (`time/wait_data`) more than BOTTLENECK_WAIT_SHARE of
    the step (`time/step`), else 'training' (train + weight sync + bookkeeping); None without both."""
    if "time/wait_data" not in metrics or not metrics.get("time/step"):
        return None
    share = metrics["time/wait_data"] / metrics["time/step"]
    return "rollout" if share > BOTTLENECK_WAIT_SHARE[is_async] else "training"


def console_line(step: int, max_steps: int, metrics: dict[str, float], is_async: bool = False) -> str:
    parts = [f"step {step}/{max_steps}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    val = [
        f"{k.removeprefix('val/em/')} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith("val/em/")
    ]
    if val:
        parts.append("val_em " + " ".join(val))
    side = bottleneck(metrics, is_async)
    if side is not None:
        parts.append(f"bottleneck: {side}")
    return " | ".join(parts)


def read_history(jsonl_path: str | Path, skipped: list[str] | None = None) -> list[dict[str, float]]:
    """The rows of `metrics.jsonl` (none if it does not exist); a resumed run appends, so a later row for a
    step replaces an earlier. Every row must be a JSON object with an integer `step` >= 0 and numbers for
    values, else `InputFileError` names the line. With `skipped`, an incomplete last line (a run still
    writing) is skipped and described there (host/files.py)."""
    from tandemrl.host.files import InputFileError, is_missing, iter_json_lines

    path = Path(jsonl_path)
    if is_missing(path):
        return []
    rows: dict[int, dict[str, float]] = {}
    for line_number, row in iter_json_lines(path, "metrics file", skipped=skipped):
        problem = _row_problem(row)
        if problem:
            raise InputFileError(
                f"metrics file {str(path)!r} line {line_number}: {problem}; each line is one step's row as "
                "`tandem train` writes it."
            )
        rows[row["step"]] = row
    return [rows[step] for step in sorted(rows)]


def _row_problem(row: dict) -> str | None:
    step = row.get("step")
    if "step" not in row:
        return "no `step` field"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"`step` is {json.dumps(step)[:40]}, not an integer >= 0"
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"`{key[:80]}` is {json.dumps(value)[:40]}, not a number"
    return None


def read_tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files under `logdir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events_file in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        if not events_file.is_file():  # a pipe or device by that name would block or never end
            continue
        acc = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars
