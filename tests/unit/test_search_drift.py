"""benchmarks/learning/search_drift.py: the per-run figures and the per-mode summary, read from fabricated
metric logs and configs (the script's only inputs are those files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks.learning.search_drift import main, read_run


def fake_run(
    run_dir: Path, async_mode: bool, searches: tuple[float, float], advantage: float, steps=40
) -> Path:
    """kb_2hop searches moving linearly from searches[0] at step 1 to searches[1] at the last step, a constant
    kb_1hop search advantage, half the prefix hits stale in async, and val EM at 0 and the last step."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {"runner": {"async_mode": async_mode}, "rollout_buffer": {"max_head_offpolicyness": 2}}
        )
    )
    rows = [{"step": 0, "val/em/kb_2hop": 0.3}]
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "rollout/num_searches/kb_2hop": searches[0]
                + (searches[1] - searches[0]) * (step - 1) / (steps - 1),
                "rollout/reward/kb_2hop": 0.2,
                "rollout/search_advantage/kb_1hop": advantage,
                "rollout/engine_prefix_hit_tokens": 100,
                "rollout/engine_stale_prefix_hit_tokens": 50 if async_mode else 0,
            }
        )
    rows.append({"step": steps, "val/em/kb_2hop": 0.5 if async_mode else 0.6})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def test_a_run_read_from_its_files(tmp_path):
    run = read_run(fake_run(tmp_path / "a", True, (1.5, 1.2), -0.04), (1, 10), (31, 40))
    assert run["mode"] == "async" and run["config"]["rollout_buffer.max_head_offpolicyness"] == 2
    step = 0.3 / 39
    assert run["searches_2hop_first"] == pytest.approx(1.5 - step * 4.5)  # the mean over steps 1-10
    assert run["searches_2hop_last"] == pytest.approx(1.5 - step * 34.5)
    assert run["search_advantage_1hop"] == pytest.approx(-0.04)
    assert run["stale_prefix_hit_share"] == pytest.approx(0.5) and run["val_kb_2hop_end"] == 0.5


def test_a_run_short_of_the_last_window_or_without_config_is_left_out(tmp_path):
    assert (
        read_run(fake_run(tmp_path / "short", False, (1.5, 1.8), -0.02, steps=20), (1, 10), (26, 40)) is None
    )
    bare = fake_run(tmp_path / "bare", False, (1.5, 1.8), -0.02)
    (bare / "config.yaml").unlink()
    assert read_run(bare, (1, 10), (26, 40)) is None


def test_the_summary_per_mode(tmp_path, capsys):
    fake_run(tmp_path / "runs/sync1", False, (1.4, 1.8), -0.02)
    fake_run(tmp_path / "runs/sync2", False, (1.5, 1.9), -0.01)
    fake_run(tmp_path / "runs/async1", True, (1.5, 1.2), -0.05)
    fake_run(tmp_path / "runs/async2", True, (1.4, 1.7), -0.03)
    out = tmp_path / "drift.json"
    result = main(["--runs-glob", str(tmp_path / "runs/*"), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    sync, asynchronous = result["by_mode"]["sync"], result["by_mode"]["async"]
    assert sync["runs"] == asynchronous["runs"] == 2
    assert sync["runs_whose_2hop_searches_fell"] == 0 and asynchronous["runs_whose_2hop_searches_fell"] == 1
    assert asynchronous["search_advantage_1hop"] == pytest.approx(
        {"mean": -0.04, "min": -0.05, "max": -0.03, "runs": 2}
    )
    assert sync["stale_prefix_hit_share"]["max"] == 0.0
    assert "async: 2 runs, kb_2hop searches fell in 1" in capsys.readouterr().out


def test_no_run_found_says_where_it_looked(tmp_path):
    with pytest.raises(SystemExit, match="no run under .*nothing"):
        main(["--runs-glob", str(tmp_path / "nothing/*"), "--out", str(tmp_path / "x.json")])
