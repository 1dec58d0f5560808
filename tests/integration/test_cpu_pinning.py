"""`cluster.cpu_pinning=always` in a real `tandem train` under a local Ray (the CLI as a subprocess): at
the first step the actor rank's every thread runs on its own cores, an engine with cores of its own on
those, and no other thread of any process of the run (driver, retrieval server, engine, Ray's daemons and
workers) may run on the actor's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandemrl.host.cpus import available_cpus, can_pin
from tests.integration.test_faults import Run, small_kb  # noqa: F401  (the module's KB fixture)

pytestmark = pytest.mark.skipif(
    not can_pin() or len(available_cpus()) < 2, reason="needs Linux CPU affinity and 2 cores"
)


def _thread_cores(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid` -> the cores it may run on."""
    cores = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores[int(tid)] = os.sched_getaffinity(int(tid))
        except (ProcessLookupError, FileNotFoundError):
            continue  # the thread ended meanwhile
    return cores


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def test_the_actor_keeps_its_cores_to_itself(tmp_path, tiny_llama_dir, small_kb):  # noqa: F811
    cpus = available_cpus()
    engine_cores = 1 if len(cpus) >= 3 else 0  # the engine gets one of its own where the machine has it
    run = Run(
        tmp_path,
        tiny_llama_dir,
        small_kb,
        "cluster.use_ray=true",
        "cluster.cpu_pinning=always",
        "cluster.cpus_per_actor_rank=1",
        f"cluster.cpus_per_engine={engine_cores}",
    )
    try:
        run.wait_first_step()
        actor_cores = {cpus[-1]}
        engine_own = {cpus[-2]} if engine_cores else None
        pids = run.pids_of("")  # every process of the run
        actors = [p for p in pids if "ActorWorker" in _cmdline(p)]
        engines = [p for p in pids if "serve-engine" in _cmdline(p)]
        assert len(actors) == 1 and len(engines) == 1, {p: _cmdline(p)[:80] for p in pids}
        for tid, cores in _thread_cores(actors[0]).items():
            assert cores == actor_cores, f"actor thread {tid} may run on {sorted(cores)}"
        for pid in set(pids) - set(actors):
            for tid, cores in _thread_cores(pid).items():
                assert not cores & actor_cores, (
                    f"{_cmdline(pid)[:80]} (thread {tid}) may use the actor's core"
                )
        if engine_own is not None:
            for tid, cores in _thread_cores(engines[0]).items():
                assert cores == engine_own, f"engine thread {tid} may run on {sorted(cores)}"
    finally:
        os.killpg(run.proc.pid, 2)
        code, stderr = run.finish()
    assert f"actor rank 0 runs on cores {cpus[-1]}" in stderr
    run.assert_nothing_left()
