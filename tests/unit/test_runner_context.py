"""The engines' step counters turned into a step's metrics (runner/step_metrics.py, engine_step_metrics)."""

from __future__ import annotations

import pytest

from tandemrl.runner.step_metrics import engine_step_metrics


def test_engine_step_metrics_split_the_busy_time_by_step_kind():
    delta = {
        "busy_s": 2.0,
        "prefill_busy_s": 0.5,
        "num_steps": 400,
        "num_prefill_steps": 100,
        "num_decode_rows": 300 * 96,
    }
    metrics = engine_step_metrics(delta)
    assert metrics["rollout/engine_steps"] == 400
    assert metrics["rollout/engine_prefill_steps"] == 100
    assert metrics["rollout/engine_decode_batch_mean"] == pytest.approx(96)
    assert metrics["rollout/engine_decode_step_ms"] == pytest.approx(1000 * 1.5 / 300)
    assert metrics["rollout/engine_prefill_step_ms"] == pytest.approx(1000 * 0.5 / 100)


def test_spec_metrics_from_the_engines_counters():
    delta = {
        "busy_s": 1.0,
        "num_steps": 10,
        "num_prefill_steps": 0,
        "num_decode_rows": 80,
        "num_decode_emitted_tokens": 200,
        "num_spec_draft_tokens": 300,
        "num_spec_accepted_tokens": 120,
    }
    metrics = engine_step_metrics(delta)
    assert metrics["rollout/spec/acceptance_rate"] == pytest.approx(0.4)
    assert metrics["rollout/spec/tokens_per_step"] == pytest.approx(2.5)
    assert metrics["rollout/engine_decode_rows"] == 80
    plain = engine_step_metrics(delta | {"num_decode_emitted_tokens": 80, "num_spec_draft_tokens": 0})
    assert plain["rollout/spec/tokens_per_step"] == 1 and "rollout/spec/acceptance_rate" not in plain


def test_engine_step_metrics_without_steps_or_counters():
    assert engine_step_metrics({"busy_s": 0.0, "num_steps": 0}) == {}
    assert engine_step_metrics({"busy_s": 1.0}) == {}  # an engine that reports no step counters
    only_prefill = engine_step_metrics(
        {"busy_s": 1.0, "prefill_busy_s": 1.0, "num_steps": 4, "num_prefill_steps": 4}
    )
    assert "rollout/engine_decode_step_ms" not in only_prefill
    assert only_prefill["rollout/engine_prefill_step_ms"] == pytest.approx(250)


def test_trajectory_time_metrics_split_the_wall_time():
    from types import SimpleNamespace

    from tandemrl.runner.step_metrics import trajectory_time_metrics

    trajectories = [
        SimpleNamespace(wall_s=2.0, generate_s=1.5, server_s=1.0, search_s=0.25),
        SimpleNamespace(wall_s=4.0, generate_s=2.5, server_s=2.0, search_s=0.75),
    ]
    metrics = trajectory_time_metrics(trajectories)
    assert metrics["rollout/traj/wall_s"] == pytest.approx(3.0)
    assert metrics["rollout/traj/http_s"] == pytest.approx(0.5)
    assert metrics["rollout/traj/search_s"] == pytest.approx(0.5)
    assert metrics["rollout/traj/agent_s"] == pytest.approx(3.0 - 2.0 - 0.5)
    no_server = [SimpleNamespace(wall_s=1.0, generate_s=0.5, server_s=0.0, search_s=0.0)]
    assert "rollout/traj/http_s" not in trajectory_time_metrics(no_server)
    assert trajectory_time_metrics([SimpleNamespace(wall_s=0.0)]) == {}


def test_engine_step_profile_records_the_steps_asked_for(tmp_path, monkeypatch):
    import pstats

    from tandemrl.engine.loop import StepProfile

    path = tmp_path / "engine.prof"
    monkeypatch.setenv("TANDEM_ENGINE_PROFILE", f"{path}:2:3")
    profile = StepProfile.from_env()

    def work():
        return sum(range(1000))

    for step in range(8):
        profile.tick(step)
        work()
    assert profile.state == "done" and path.is_file()
    calls = [v[0] for k, v in pstats.Stats(str(path)).stats.items() if k[2] == "work"]
    assert calls == [3]  # steps 2, 3 and 4
    monkeypatch.delenv("TANDEM_ENGINE_PROFILE")
    assert StepProfile.from_env() is None
