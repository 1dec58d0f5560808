"""benchmarks/runner/colocated.py sums what held the driver's loop over a run, from the lines the runner
writes (tandemrl/runner/step.py `loop_metrics`)."""

from __future__ import annotations

import json

from benchmarks.runner.colocated import loop_stall_sites


def test_sites_are_summed_over_the_run_and_ranked(tmp_path):
    lines = [
        {
            "wall": 3.0,
            "stalled_s": 0.3,
            "where": {"runner/records.py:40 write_trajectories": 0.2, "a.py:1 f": 0.1},
        },
        {
            "wall": 6.0,
            "stalled_s": 0.25,
            "where": {"runner/records.py:40 write_trajectories": 0.15, "b.py:2 g": 0.1},
        },
    ]
    (tmp_path / "loop_stalls.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    sites = loop_stall_sites(tmp_path, top=2)
    assert list(sites) == ["runner/records.py:40 write_trajectories", "a.py:1 f"]
    assert abs(sites["runner/records.py:40 write_trajectories"] - 0.35) < 1e-9
    assert loop_stall_sites(tmp_path / "no_run") == {}  # a run from before the monitor
