"""Every benchmark run compiles inside its own clock (benchmarks/runner/runs.py, `run_env`): a cache left on
the machine by an earlier run must not shorten a later one's first step; with a warm-up's cache named, every
run starts from its own copy of that same snapshot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.runner import runs
from benchmarks.runner.runs import WARM_CACHE_ENV, process_wall, run_env, run_train


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


def test_a_run_keeps_its_process_wall_for_a_later_summary(tmp_path: Path, monkeypatch):
    """The benchmark runs one part per invocation (colocated_h200.sh), so the summary that compares them is
    made by a later one: each run's whole-process wall time is kept in its directory."""
    import time

    commands = []

    def fake_tandem_train(command, check, cwd, env):  # a fake at the process boundary: no real run
        commands.append(command)
        time.sleep(0.05)

    monkeypatch.delenv(WARM_CACHE_ENV, raising=False)
    monkeypatch.setattr(runs.subprocess, "run", fake_tandem_train)
    wall = run_train("recipe.yaml", tmp_path / "sync", 3, ["runner.val_interval=10"])
    assert "runner.max_steps=3" in commands[0] and commands[0][-1] == "runner.val_interval=10"
    assert wall >= 0.05
    assert process_wall(tmp_path / "sync") == wall
    assert process_wall(tmp_path / "never_ran") is None
