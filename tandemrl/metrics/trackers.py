"""Experiment trackers (`metrics.trackers`): TensorBoard, Weights & Biases, MLflow.

Every tracker gets every metric of a step under the same name (SPEC §7), at the same step (the rollout
step), and the run's resolved config once at start. Invariants: a tracker that cannot start fails the
run at start-up with one line naming it (`TrackerError`); a tracker that raises later is dropped with
one warning and the run goes on (losing a dashboard never loses a training run; metrics.jsonl keeps
every number). wandb and mlflow are optional extras, imported only when named; a resumed run continues
the tracker runs it started (their ids are kept in `<output_dir>/trackers.json`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tandemrl.config.errors import ConfigError

if TYPE_CHECKING:
    from tandemrl.config.schema import MetricsConfig, MlflowConfig, TandemConfig, WandbConfig

log = logging.getLogger(__name__)

INSTALL = {  # tracker -> (module it needs, the install line)
    "wandb": ("wandb", "pip install 'tandemrl[wandb]'"),
    "mlflow": ("mlflow", "pip install 'tandemrl[mlflow]'"),
}
IDS_FILE = "trackers.json"


class TrackerError(ConfigError):
    """A tracker could not start (one line: which tracker, why, what to do)."""


class Tracker(Protocol):
    """What the metrics logger needs of a tracker (each class below is one)."""

    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_installed(trackers: list[str]) -> None:
    """ConfigError with the install line for a named tracker whose package is not installed."""
    for name in trackers:
        if name in INSTALL and importlib.util.find_spec(INSTALL[name][0]) is None:
            raise ConfigError(
                f"metrics.trackers names {name}, which is not installed. Install it with "
                f"`{INSTALL[name][1]}`, or remove {name} from metrics.trackers."
            )


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, logdir: Path, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter  # torch's writer: tensorboard event files

        self._writer = SummaryWriter(log_dir=str(logdir))
        if config is not None:
            self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in sorted(metrics.items()):
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, output_dir: Path, config: dict | None, run_id: str | None):
        import wandb

        mode = cfg.mode or os.environ.get("WANDB_MODE") or "online"
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name or output_dir.name,
            tags=list(cfg.tags) or None,
            dir=str(output_dir),
            config=config,
            mode=mode,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
        )
        self.run_id = self._run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, output_dir: Path, config: dict | None, run_id: str | None):
        # None: a local SQLite store in the run directory (MLflow's file-system store cannot hold a metric
        # whose name is also the prefix of another, such as time/sync_weights and time/sync_weights/pause)
        uri = cfg.tracking_uri or f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        # artifacts (config.json) beside it; MLflow's default is ./mlruns under the current directory
        artifacts = None if cfg.tracking_uri else (output_dir / "mlflow_artifacts").resolve().as_uri()
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = client.get_experiment_by_name(cfg.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
            )
            run_id = client.create_run(experiment_id, run_name=cfg.run_name or output_dir.name).info.run_id
            if config is not None:
                self._log_config(run_id, config)
        self.run_id, self.tracking_uri = run_id, uri

    def _log_config(self, run_id: str, config: dict) -> None:
        from mlflow.entities import Param

        from tandemrl.config.loader import flatten_keys

        flat = flatten_keys(config)  # params are searchable in the UI; the whole config is an artifact too
        params = [Param(key, str(value)[:6000]) for key, value in flat.items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self._client.log_batch(run_id, params=params[i : i + 100])
        self._client.log_dict(run_id, config, "config.json")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        rows = [Metric(key, value, now_ms, step) for key, value in sorted(metrics.items())]
        for i in range(0, len(rows), 1000):
            self._client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def start_trackers(
    names: list[str], metrics_cfg: MetricsConfig, output_dir: Path, config: dict | None, tensorboard_dir: Path
) -> list[Tracker]:
    """Start every named tracker (a resumed run continues its tracker runs); TrackerError names the
    one that failed, after closing those already started."""
    ids_path = output_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    started: list[Tracker] = []
    for name in names:
        try:
            if name == "tensorboard":
                started.append(TensorBoardTracker(tensorboard_dir, config))
            elif name == "wandb":
                check_installed([name])
                started.append(WandbTracker(metrics_cfg.wandb, output_dir, config, ids.get(name)))
            elif name == "mlflow":
                check_installed([name])
                started.append(MlflowTracker(metrics_cfg.mlflow, output_dir, config, ids.get(name)))
            else:
                raise ConfigError(f"unknown tracker {name!r}: use tensorboard, wandb or mlflow.")
        except Exception as error:
            for tracker in started:
                _close_quietly(tracker)
            if isinstance(error, ConfigError):
                raise
            raise TrackerError(f"metrics.trackers: {name} failed to start: {_one_line(error)}") from None
    ids.update({t.name: t.run_id for t in started if hasattr(t, "run_id")})
    if ids:
        ids_path.write_text(json.dumps(ids) + "\n")
    return started


def resolved_config(config: TandemConfig) -> dict:
    """The run's resolved config as the trackers get it: every key, API keys shown only as `<set>` (it
    serializes every section, hence the whole `TandemConfig`; runner/session.py hands it over)."""
    from tandemrl.config.loader import to_dict

    def redact(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: ("<set>" if k == "api_key" and v is not None else redact(v)) for k, v in tree.items()}
        return tree

    return redact(to_dict(config))


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception as error:
        log.warning("metrics.trackers: closing %s failed: %s", tracker.name, _one_line(error))


def _one_line(error: BaseException) -> str:
    from tandemrl.host.messages import one_line

    return one_line(error)
