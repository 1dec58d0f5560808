"""Metrics logger (TensorBoard + jsonl + console line) and plots on the parameter-updates axis."""

from __future__ import annotations

import json

import pytest

from tandemrl.metrics.logger import (
    MetricsLogger,
    bottleneck,
    console_line,
    read_history,
    read_tensorboard_scalars,
)
from tandemrl.metrics.plots import write_plots


def test_logger_writes_tensorboard_jsonl_and_console(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, max_steps=2, show_progress=False)
    logger.log(1, {"rollout/reward/mean": 0.25, "time/step": 2.0, "throughput": 100.0, "val/em/kb_1hop": 0.5})
    logger.log(2, {"rollout/reward/mean": 0.5, "time/step": 1.0, "bad": float("nan")})
    logger.close()
    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["rollout/reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert "bad" not in scalars and scalars["val/em/kb_1hop"] == [(1, 0.5)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[1]["time/step"] == 1.0
    out = capsys.readouterr()
    assert "step 1/2 | reward 0.250" in out.out + out.err


def test_console_line_fields():
    line = console_line(
        3,
        10,
        {
            "rollout/reward/mean": 0.125,
            "rollout/data_staleness/mean": 1.0,
            "time/step": 12.34,
            "throughput": 456.7,
            "val/em/all": 0.3,
        },
    )
    assert line == "step 3/10 | reward 0.125 | staleness 1.00 | step_s 12.3 | tok/s 457 | val_em all 0.300"


@pytest.mark.parametrize(
    "wait_s, is_async, side",
    [
        (0.0, True, "training"),
        (1.0, True, "training"),  # exactly 10 % of the step: not more than the share
        (1.01, True, "rollout"),
        (4.0, False, "training"),  # sync: generating 40 % of the step, training and sync the rest
        (5.0, False, "training"),
        (6.0, False, "rollout"),
    ],
)
def test_bottleneck_is_the_share_of_the_step_spent_waiting_for_data(wait_s, is_async, side):
    assert bottleneck({"time/wait_data": wait_s, "time/step": 10.0}, is_async) == side


def test_no_bottleneck_without_the_step_time_breakdown():
    assert bottleneck({"time/step": 10.0}, True) is None
    assert bottleneck({"time/wait_data": 1.0, "time/step": 0.0}, True) is None


def test_console_line_shows_the_breakdown_and_the_bottleneck():
    metrics = {
        "time/step": 2.0,
        "time/wait_data": 0.8,
        "time/train": 0.9,
        "time/sync_weights": 0.25,
        "rollout/engine_busy_fraction": 0.75,
    }
    line = console_line(1, 2, metrics, is_async=True)
    assert line == (
        "step 1/2 | step_s 2.0 | wait_s 0.8 | train_s 0.9 | sync_s 0.2 | engine_busy 0.75 | bottleneck: rollout"
    )
    assert console_line(1, 2, metrics, is_async=False).endswith("bottleneck: training")


def test_history_keeps_the_latest_row_of_a_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 2, "a": 3}\n')
    assert [r["a"] for r in read_history(tmp_path / "metrics.jsonl")] == [1, 3]


def test_plots_use_parameter_updates_axis(tmp_path):
    import matplotlib.image

    rows = [
        {
            "step": s,
            "rollout/reward/mean": 0.1 * s,
            "time/step": 1.0,
            "rollout/data_staleness/mean": 1.0,
            "rollout/buffer/size": 2.0,
        }
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = write_plots(tmp_path, n_minibatches=4)
    assert sorted(p.name for p in paths) == ["buffer.png", "reward.png", "staleness.png", "step_time.png"]
    image = matplotlib.image.imread(paths[0])
    assert image.shape[0] > 100 and image.shape[1] > 100

    import matplotlib.pyplot as plt

    from tandemrl.metrics import plots

    captured = {}
    original = plt.Figure.savefig

    def capture(fig, path, **kw):
        captured[path.name] = fig.axes[0]
        return original(fig, path, **kw)

    plt.Figure.savefig = capture
    try:
        plots.write_plots(tmp_path, n_minibatches=4)
    finally:
        plt.Figure.savefig = original
    ax = captured["reward.png"]
    assert list(ax.lines[0].get_xdata()) == [4, 8, 12]
    assert "parameter updates" in ax.get_xlabel()


def test_a_step_with_many_failed_searches_warns_naming_the_retrieval_server(caplog):
    from types import SimpleNamespace

    from tandemrl.config.loader import load_config
    from tandemrl.runner.step_metrics import warn_on_search_errors

    ctx = SimpleNamespace(
        config=load_config(None, ["tools.search.warn_error_fraction=0.25"]),
        driver=SimpleNamespace(search=SimpleNamespace(url="http://127.0.0.1:8123/retrieve")),
    )
    metrics = {
        "rollout/num_searches/mean": 2.0,
        "rollout/total_num_sequence": 4.0,
        "rollout/search_errors": 2.0,
    }
    with caplog.at_level("WARNING"):
        warn_on_search_errors(ctx, 3, metrics)  # 2 of 8 = 0.25: not past the threshold
    assert not caplog.records
    with caplog.at_level("WARNING"):
        warn_on_search_errors(ctx, 4, {**metrics, "rollout/search_errors": 3.0})
    (record,) = caplog.records
    assert "step 4: 3 of 8 searches failed" in record.getMessage() and "127.0.0.1:8123" in record.getMessage()
