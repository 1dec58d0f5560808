"""The experiment trackers behind MetricsLogger: TensorBoard, wandb (offline) and MLflow (a local file
store) each get every metric under its name at its step, with the resolved config; a tracker that cannot
start fails in one line; one that raises later is dropped with one warning while the others go on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.metrics.logger import MetricsLogger, read_history, read_tensorboard_scalars
from tandemrl.metrics.trackers import MlflowTracker, TrackerError, check_installed, resolved_config
from tests.tracker_readback import mlflow_run, offline_wandb, wandb_offline_run

STEPS = {  # a name that is also the prefix of others, as in SPEC §7 (time/sync_weights and its parts)
    1: {
        "rollout/reward/mean": 0.25,
        "time/sync_weights": 3.5,
        "time/sync_weights/pause": 0.5,
        "val/em/kb_1hop": 0.5,
    },
    2: {
        "rollout/reward/mean": 0.75,
        "time/sync_weights": 2.0,
        "time/sync_weights/pause": 0.25,
        "train/actor/lr": 1e-6,
    },
}


def make_logger(tmp_path, *overrides):
    config = load_config(None, [f"runner.output_dir={tmp_path / 'run'}", *overrides])
    return config, MetricsLogger(
        config.runner.output_dir,
        max_steps=2,
        show_progress=False,
        metrics_cfg=config.metrics,
        config=resolved_config(config),
    )


def test_every_metric_reaches_every_tracker_at_its_step(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path)
    config, logger = make_logger(
        tmp_path,
        "metrics.trackers=[tensorboard,wandb,mlflow]",
        "metrics.wandb.project=proj",
        "rollout.api_key=secret-engine-key",
    )
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()
    expected = {}
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            expected.setdefault(key, []).append((step, value))
    output_dir = tmp_path / "run"
    tensorboard = read_tensorboard_scalars(output_dir / "tensorboard")
    wandb_run = wandb_offline_run(output_dir)
    mlflow = mlflow_run(output_dir)
    for name, history in (
        ("tensorboard", tensorboard),
        ("wandb", wandb_run["history"]),
        ("mlflow", mlflow["history"]),
    ):
        got = {key: [(s, pytest.approx(v, rel=1e-6)) for s, v in values] for key, values in history.items()}
        assert got == expected, name
    assert wandb_run["project"] == "proj" and wandb_run["name"] == "run"
    assert wandb_run["config"]["data"]["rollout_batch_size"] == config.data.rollout_batch_size
    assert mlflow["params"]["data.rollout_batch_size"] == str(config.data.rollout_batch_size)
    assert mlflow["status"] == "FINISHED" and mlflow["artifacts"] == ["config.json"]
    assert mlflow["artifact_uri"].startswith((output_dir / "mlflow_artifacts").resolve().as_uri())
    for attached in (wandb_run["config"]["rollout"]["api_key"], mlflow["params"]["rollout.api_key"]):
        assert attached == "<set>"  # a secret is never sent to a dashboard
    assert [row["step"] for row in read_history(output_dir / "metrics.jsonl")] == [1, 2]


def test_a_tracker_raising_mid_run_is_dropped_with_one_warning(tmp_path, monkeypatch, caplog):
    """MlflowTracker.log raising stands in for the tracking store failing (disk full, server gone)."""
    offline_wandb(monkeypatch, tmp_path)
    _, logger = make_logger(tmp_path, "metrics.trackers=[tensorboard,mlflow]")
    calls = []

    def failing_log(self, step, metrics):
        calls.append(step)
        raise OSError("No space left on device")

    logger.log(1, STEPS[1])
    monkeypatch.setattr(MlflowTracker, "log", failing_log)
    with caplog.at_level(logging.WARNING):
        logger.log(2, STEPS[2])
        logger.log(3, {"rollout/reward/mean": 1.0})
        logger.close()
    warnings = [r.message for r in caplog.records if "metrics.trackers" in r.message]
    assert (
        len(warnings) == 1
        and "mlflow logging step 2 failed" in warnings[0]
        and "No space left" in warnings[0]
    )
    assert calls == [2]  # dropped after its first failure
    assert [
        s for s, _ in read_tensorboard_scalars(tmp_path / "run" / "tensorboard")["rollout/reward/mean"]
    ] == [1, 2, 3]
    assert [r["step"] for r in read_history(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert [s for s, _ in mlflow_run(tmp_path / "run")["history"]["rollout/reward/mean"]] == [1]


def test_a_tracker_that_cannot_start_fails_in_one_line(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path)
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    with pytest.raises(TrackerError) as error:
        make_logger(
            tmp_path,
            "metrics.trackers=[tensorboard,mlflow]",
            f"metrics.mlflow.tracking_uri=sqlite:///{not_a_dir}/mlflow.db",
        )
    message = str(error.value)
    assert message.startswith("metrics.trackers: mlflow failed to start: ") and "\n" not in message


def test_the_mlflow_file_store_is_refused_for_its_metric_names():
    with pytest.raises(ConfigError, match="cannot hold a metric named like the prefix of another"):
        load_config(None, ["metrics.mlflow.tracking_uri=file:///tmp/mlruns"])


def test_a_tracker_that_is_not_installed_is_refused_with_the_install_line(monkeypatch, capsys):
    """`tandem config show` (and `tandem train`, through the same preflight) with wandb made unfindable,
    as on a machine without the extra."""
    import importlib.util

    from tandemrl.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a)
    )
    config = str(
        Path(__file__).resolve().parents[2] / "examples" / "searchr1" / "config" / "embedded_cpu_async.yaml"
    )
    assert main(["config", "show", config, "metrics.trackers=[tensorboard,wandb]"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tandem: configuration error: metrics.trackers names wandb, which is not installed. Install it with "
        "`pip install 'tandemrl[wandb]'`, or remove wandb from metrics.trackers.\n"
    )
    check_installed(["tensorboard", "mlflow"])
    assert main(["config", "show", config, "metrics.trackers=[tensorboard,mlflow]"]) == 0


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """The wandb and mlflow run ids are kept in trackers.json; a second logger on the same output_dir
    (what a resume does) logs into the same runs."""
    import json

    offline_wandb(monkeypatch, tmp_path)
    _, first = make_logger(tmp_path, "metrics.trackers=[wandb,mlflow]")
    first.log(1, STEPS[1])
    first.close()
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    _, resumed = make_logger(tmp_path, "metrics.trackers=[wandb,mlflow]")
    assert {t.name: t.run_id for t in resumed.trackers} == ids
    resumed.log(2, STEPS[2])
    resumed.close()
    mlflow = mlflow_run(tmp_path / "run")  # one run, both steps
    assert mlflow["run_id"] == ids["mlflow"] and [s for s, _ in mlflow["history"]["rollout/reward/mean"]] == [
        1,
        2,
    ]
