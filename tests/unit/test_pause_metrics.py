"""`runner/step.py` `pause_metrics`: the slowest engine's pause split as the embedded engine reports it;
backends that report nothing (vLLM's client returns None, SGLang no timing) add no metric."""

from __future__ import annotations

from tandemrl.runner.step import pause_metrics


def test_the_slowest_engine_counts_in_milliseconds():
    answers = [
        {"pause_queued_s": 0.002, "pause_drain_s": 0.004, "num_running": 3},
        {"pause_queued_s": 0.010, "pause_drain_s": 0.001},
    ]
    metrics = pause_metrics(answers)
    assert metrics == {"rollout/engine_pause_queued_ms": 10.0, "rollout/engine_pause_drain_ms": 4.0}


def test_backends_without_timing_add_nothing():
    assert pause_metrics([None, {"status": "ok"}, "text"]) == {}
    assert pause_metrics([]) == {}
