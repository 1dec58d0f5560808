"""Every benchmark run compiles inside its own clock (benchmarks/runner/runs.py, `run_env`): a cache left on
the machine by an earlier run must not shorten a later one's first step; with a warm-up's cache named, every
run starts from its own copy of that same snapshot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.runner.runs import WARM_CACHE_ENV, run_env


def test_each_run_gets_an_empty_inductor_cache_of_its_own(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(WARM_CACHE_ENV, raising=False)
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


def test_each_run_starts_from_its_own_copy_of_the_warm_up_cache(tmp_path: Path, monkeypatch):
    warm = tmp_path / "warmup" / "inductor_cache" / "fxgraph"
    warm.mkdir(parents=True)
    (warm / "entry").write_text("compiled by the untimed warm-up")
    monkeypatch.setenv(WARM_CACHE_ENV, str(tmp_path / "warmup" / "inductor_cache"))
    env = run_env(tmp_path / "sync")
    run_cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert (run_cache / "fxgraph" / "entry").read_text() == "compiled by the untimed warm-up"
    (run_cache / "fxgraph" / "sync_only").write_text("compiled in the sync run's clock")
    other = Path(run_env(tmp_path / "async")["TORCHINDUCTOR_CACHE_DIR"])
    assert sorted(p.name for p in (other / "fxgraph").iterdir()) == ["entry"], (
        "a run never sees another's additions"
    )
    assert not (warm / "sync_only").exists(), "the snapshot itself is left as the warm-up wrote it"
