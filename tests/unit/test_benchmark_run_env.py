"""Every benchmark run compiles cold inside its own clock (benchmarks/runner/runs.py, `run_env`): a cache
left on the machine by an earlier run must not shorten a later one's first step."""

from __future__ import annotations

from pathlib import Path

from benchmarks.runner.runs import run_env


def test_each_run_gets_an_empty_inductor_cache_of_its_own(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine_cache"))
    stale = tmp_path / "sync" / "inductor_cache" / "fxgraph"
    stale.mkdir(parents=True)
    (stale / "entry").write_text("compiled by an earlier run")

    env = run_env(tmp_path / "sync")
    other = run_env(tmp_path / "async")

    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "sync" / "inductor_cache").resolve())
    assert not (tmp_path / "sync" / "inductor_cache").exists(), "what an earlier run compiled is emptied"
    assert other["TORCHINDUCTOR_CACHE_DIR"] != env["TORCHINDUCTOR_CACHE_DIR"]
    assert env["PATH"], "the rest of the environment is the caller's"
