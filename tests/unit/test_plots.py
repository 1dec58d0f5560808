"""`tandem plot`: several runs overlaid from their logs (metrics.jsonl, or TensorBoard event files only),
on steps, wall-clock time and parameter updates. The runs are fabricated metric logs: this checks the
plotting, whose input is only those files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from tandemrl.cli import main
from tandemrl.metrics.logger import MetricsLogger
from tandemrl.metrics.plots import OVERLAYS, load_run, overlay_runs, run_labels


def _rows(step_s: float, num_updates_per_step: int | None) -> list[dict]:
    rows = []
    for step in (1, 2, 3, 4):
        row = {
            "step": step,
            "time/step": step_s,
            "rollout/reward/mean": 0.1 * step,
            "train/actor/ratio_abs": 0.01 * step,
            "rollout/data_staleness/mean": 1.0,
            "rollout/num_searches/mean": 1.5,
            "rollout/num_searches/kb_1hop": 1.0,
            "rollout/num_searches/kb_2hop": 2.0 - 0.1 * step,
        }
        if num_updates_per_step is not None:
            row["train/actor/num_updates"] = float(num_updates_per_step * step)
        if step % 2 == 0:
            row["val/em/all"] = 0.2 + 0.1 * step
            row["val/em/kb_2hop"] = 0.1 * step
            row["val/num_searches/kb_2hop"] = 2.0
        rows.append(row)
    return rows


def _jsonl_run(root: Path) -> Path:
    """A sync-like run: metrics.jsonl with the actor's update count (4 updates per step)."""
    run = root / "sync-20260101"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(2.0, 4)))
    return run


def _tensorboard_run(root: Path) -> Path:
    """An async-like run with TensorBoard events only, no update count, n_minibatches in config.yaml."""
    run = root / "async-20260101"
    logger = MetricsLogger(run, max_steps=4, show_progress=False)
    for row in _rows(1.0, None):
        logger.log(row["step"], {k: v for k, v in row.items() if k != "step"})
    logger.close()
    (run / "metrics.jsonl").unlink()
    (run / "config.yaml").write_text("runner:\n  name: async\nalgorithm:\n  n_minibatches: 2\n")
    return run


def test_two_runs_are_overlaid_on_each_axis(tmp_path):
    runs = [load_run(_jsonl_run(tmp_path)), load_run(_tensorboard_run(tmp_path))]
    plotted = overlay_runs(runs, tmp_path / "out")
    for stem in OVERLAYS:
        image = matplotlib.image.imread(tmp_path / "out" / f"{stem}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100
    sync, asyn = "sync-20260101", "async-20260101"
    assert plotted["step_time"][sync] == ([1, 2, 3, 4], [2.0] * 4)
    assert plotted["reward_vs_time"][sync][0] == [2.0, 4.0, 6.0, 8.0]  # cumulative step time
    assert plotted["reward_vs_time"][asyn][0] == [1.0, 2.0, 3.0, 4.0]
    assert plotted["reward_vs_updates"][sync][0] == [4.0, 8.0, 12.0, 16.0]  # the actor's own count
    assert plotted["reward_vs_updates"][asyn][0] == [2, 4, 6, 8]  # step x n_minibatches from config.yaml
    assert plotted["reward_vs_updates"][asyn][1] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert plotted["ratio_abs"][sync][1] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert plotted["staleness"][asyn][1] == [1.0] * 4
    assert plotted["val_em"][sync] == ([8.0, 16.0], pytest.approx([0.4, 0.6]))  # only steps with val EM
    # per data source: one overlay per source the runs logged, the overall series left to the above
    per_source = {
        "val_em_kb_2hop",
        "val_num_searches_kb_2hop",
        "num_searches_kb_1hop",
        "num_searches_kb_2hop",
    }
    assert set(plotted) == set(OVERLAYS) | per_source
    assert plotted["val_em_kb_2hop"][asyn] == ([4, 8], pytest.approx([0.2, 0.4]))
    assert plotted["num_searches_kb_2hop"][sync][1] == pytest.approx([1.9, 1.8, 1.7, 1.6])
    assert plotted["num_searches"][sync][1] == [1.5] * 4
    for stem in per_source:
        assert (tmp_path / "out" / f"{stem}.png").is_file()


def test_a_metric_no_run_logged_gives_an_empty_plot(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time/step": 1.0, "train/actor/num_updates": 4})
    )
    plotted = overlay_runs([load_run(run)], tmp_path / "out")
    assert plotted["val_em"] == {} and (tmp_path / "out" / "val_em.png").is_file()
    assert plotted["step_time"]["bare"] == ([1], [1.0])


def test_same_named_runs_are_told_apart_by_their_parent():
    labels = run_labels([Path("/r/sync/run"), Path("/r/async/run"), Path("/r/other")])
    assert labels == ["sync/run", "async/run", "r/other"]


def test_cli_writes_the_pngs_to_out(tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["plot", str(_jsonl_run(tmp_path)), str(_tensorboard_run(tmp_path)), "--out", str(out)]) == 0
    per_source = [
        "val_em_kb_2hop",
        "val_num_searches_kb_2hop",
        "num_searches_kb_1hop",
        "num_searches_kb_2hop",
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{stem}.png" for stem in [*OVERLAYS, *per_source])
    assert f"{len(OVERLAYS) + 4} plots of 2 run(s) in {out}" in capsys.readouterr().out


def test_cli_errors_name_the_run(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "missing' does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "no metrics.jsonl and no TensorBoard event files" in capsys.readouterr().err
    unplaced = tmp_path / "unplaced"
    unplaced.mkdir()
    (unplaced / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward/mean": 0.5}))
    assert main(["plot", str(unplaced), "--out", str(tmp_path / "o")]) == 2
    assert "parameter updates are unknown" in capsys.readouterr().err
