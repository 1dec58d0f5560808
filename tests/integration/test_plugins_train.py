"""One 2-step CPU `tandem train` (async runner, embedded engine, retrieval server, tiny Llama) with all three
trackers and a custom reward given by path, read back for several checks at once:
- every metric of SPEC §7 reaches TensorBoard, the wandb offline run files and the MLflow file store, at the
  same steps and values, with the resolved config attached;
- MLflow raising at step 2 (a stand-in for its store failing) leaves the run finished, with one warning;
- the reward logged is the custom function's, per trajectory and in the step means, with its extra metric.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from tandemrl.commands.train import train
from tandemrl.config.loader import load_config
from tandemrl.metrics.logger import read_tensorboard_scalars
from tandemrl.metrics.trackers import MlflowTracker
from tests.integration.runner_helpers import DESIGN_METRICS, small_kb_once, tiny_overrides
from tests.tracker_readback import mlflow_run, offline_wandb, wandb_offline_run

REWARD = """
def reward(golden_answers, data_source):
    return {"score": 0.5 + len(golden_answers[0]) / 100, "gold_chars": float(len(golden_answers[0]))}
"""


def expected_reward(golden_answers: list[str]) -> float:
    return 0.5 + len(golden_answers[0]) / 100


@pytest.fixture(scope="module")
def run(tmp_path_factory, minilm_dir, tiny_llama_dir):
    """The run, with MLflow failing from step 2 on; returns (config, caplog records' messages)."""
    root = tmp_path_factory.mktemp("plugins_train")
    kb_dir, index_dir = small_kb_once(tmp_path_factory, minilm_dir)
    reward_path = root / "gold_length_reward.py"
    reward_path.write_text(textwrap.dedent(REWARD))
    monkeypatch = pytest.MonkeyPatch()
    offline_wandb(monkeypatch, root)
    real_log = MlflowTracker.log

    def log_until_step_2(self, step, metrics):
        if step >= 2:
            raise ConnectionError("tracking server went away")
        real_log(self, step, metrics)

    monkeypatch.setattr(MlflowTracker, "log", log_until_step_2)
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, root / "run") + [
        "runner.async_mode=true",
        "runner.max_steps=2",
        "runner.val_interval=2",
        "runner.val_before_train=true",
        "metrics.trackers=[tensorboard,wandb,mlflow]",
        "metrics.wandb.mode=offline",
        f"reward.function={reward_path}:reward",
    ]
    handler = _ListHandler()
    logging.getLogger("tandemrl").addHandler(handler)
    try:
        config = load_config(None, overrides)
        ctx = train(config)
    finally:
        logging.getLogger("tandemrl").removeHandler(handler)
        monkeypatch.undo()
    assert ctx.weight_version == 2  # both steps trained and synced: the tracker failure cost nothing
    return config, handler.messages


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_every_metric_reaches_all_three_trackers(run):
    config, _ = run
    output_dir = Path(config.runner.output_dir)
    tensorboard = read_tensorboard_scalars(output_dir / "tensorboard")
    wandb = wandb_offline_run(output_dir)
    mlflow = mlflow_run(output_dir)
    for name, history in (
        ("tensorboard", tensorboard),
        ("wandb", wandb["history"]),
        ("mlflow", mlflow["history"]),
    ):
        missing = [m for m in DESIGN_METRICS if m not in history]
        assert not missing, f"SPEC §7 metrics missing from {name}: {missing}"
    assert [s for s, _ in tensorboard["time/step"]] == [1, 2] and [
        s for s, _ in tensorboard["val/em/all"]
    ] == [0, 2]
    for key, points in tensorboard.items():
        same_points(wandb["history"][key], points, key)
        before_failure = [(s, v) for s, v in points if s < 2]  # mlflow raised at step 2 and was dropped
        same_points(mlflow["history"].get(key, []), before_failure, key)
    assert wandb["config"]["reward"]["function"] == config.reward.function
    assert wandb["config"]["runner"]["max_steps"] == 2 and mlflow["params"]["runner.max_steps"] == "2"


def same_points(got: list[tuple[int, float]], expected: list[tuple[int, float]], key: str) -> None:
    """The same steps and values (TensorBoard stores float32)."""
    assert [s for s, _ in got] == [s for s, _ in expected], key
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6, abs=1e-9), key


def test_a_tracker_failing_mid_run_leaves_the_run_finished_with_one_warning(run):
    config, messages = run
    output_dir = Path(config.runner.output_dir)
    warnings = [m for m in messages if m.startswith("metrics.trackers:")]
    assert len(warnings) == 1 and "mlflow logging step 2 failed" in warnings[0], warnings
    assert "tracking server went away" in warnings[0]
    assert (output_dir / "checkpoints" / "global_step_2").is_dir()  # the run ended normally


def test_the_custom_reward_is_the_logged_reward(run):
    config, _ = run
    output_dir = Path(config.runner.output_dir)
    tensorboard = read_tensorboard_scalars(output_dir / "tensorboard")
    for step in (1, 2):
        rows = [
            json.loads(line)
            for line in (output_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()
        ]
        assert rows and all(r["reward"] == pytest.approx(expected_reward(r["golden_answers"])) for r in rows)
        assert all(r["reward_extra"] == {"gold_chars": float(len(r["golden_answers"][0]))} for r in rows)
        mean = sum(r["reward"] for r in rows) / len(rows)
        assert dict(tensorboard["rollout/reward/mean"])[step] == pytest.approx(mean, rel=1e-6)
        assert all(r["em"] in (0.0, 1.0) for r in rows) and mean not in (0.0, 1.0)  # not exact match
        sources = {r["data_source"] for r in rows}
        for source in sources:
            golds = [len(r["golden_answers"][0]) for r in rows if r["data_source"] == source]
            logged = dict(tensorboard[f"rollout/reward_extra/gold_chars/{source}"])[step]
            assert logged == pytest.approx(sum(golds) / len(golds), rel=1e-6)


def test_a_tracker_that_cannot_start_fails_tandem_train_in_one_line(
    tmp_path, tmp_path_factory, minilm_dir, tiny_llama_dir, capsys, monkeypatch
):
    """MLflow pointed at a database under a regular file: `tandem train` starts the services, the tracker
    fails as the runner begins, and the CLI prints one line (no traceback) and exits 2, services stopped."""
    from tandemrl.cli import main

    offline_wandb(monkeypatch, tmp_path)
    kb_dir, index_dir = small_kb_once(tmp_path_factory, minilm_dir)
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + [
        "runner.max_steps=1",
        "metrics.trackers=[tensorboard,mlflow]",
        f"metrics.mlflow.tracking_uri=sqlite:///{not_a_dir}/mlflow.db",
    ]
    code = main(["train", "examples/searchr1/config/embedded_cpu_sync.yaml", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("tandem:")]
    assert len(errors) == 1, err
    assert errors[0].startswith("tandem: configuration error: metrics.trackers: mlflow failed to start: ")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
