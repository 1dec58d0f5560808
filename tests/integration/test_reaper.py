"""kill -9 of a process that started a local Ray leaves none of Ray's processes behind, its agents
included (docs/RELIABILITY.md, row 5). Ray's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) do
not reliably carry the run's id (their process title rewrites the memory /proc shows as their
environment), so the child here starts Ray with the id removed from its environment: none of Ray's
processes carries it, and the reaper must find them by the session directory the run told it. Before,
GCS and raylet ended by themselves and the two agents lived on for minutes with parent PID 1."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandemrl.cluster.reaper import GRACE_S, tagged_pids

REPO = Path(__file__).resolve().parents[2]
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
CHILD = """
import os
import time
import ray
from tandemrl.cluster.ray_nodes import init_ray
from tandemrl.cluster.reaper import start_reaper
from tandemrl.config.loader import load_config

reaper = start_reaper()
os.environ.pop("TANDEM_RUN_ID")  # Ray's processes, the agents included, start without the run's id
init_ray(load_config(None))
print(reaper.pid, ray._private.worker._global_node.get_session_dir_path(), flush=True)
time.sleep(600)
"""


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _agents(session_dir: str) -> dict[str, int]:
    """title -> pid of the Ray agents holding files of `session_dir` open."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode().strip()
            if title in AGENTS and any(
                os.readlink(fd).startswith(session_dir + "/") for fd in (entry / "fd").iterdir()
            ):
                found[title] = int(entry.name)
        except (OSError, ValueError):
            continue
    return found


def _both(agents: dict[str, int]) -> dict[str, int] | None:
    return agents if len(agents) == len(AGENTS) else None


def _wait(predicate, timeout_s: float, what: str):
    """Wait for the event; the timeout is a hang guard only."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_leaves_no_ray_agent_alive():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TANDEM_RUN_ID", None)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    agents: dict[str, int] = {}
    try:
        ready, _, _ = select.select([child.stdout], [], [], 240)
        assert ready, "the child never started Ray"
        reaper_pid, session_dir = child.stdout.readline().split()
        agents = _wait(lambda: _both(_agents(session_dir)), 120, "Ray's agents")
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        _wait(lambda: not _is_running(int(reaper_pid)), 120, "the reaper to finish")
        # the reaper has sent its SIGKILLs: the agents die at once (before, they lived for 1-3 minutes)
        left = _wait_gone(agents, 10)
        assert not left, f"still running after the reaper finished: {left}"
        assert not _session_processes(session_dir), "a process of the Ray session is still running"
    finally:
        child.kill()
        for pid in agents.values():
            if _is_running(pid):
                os.kill(pid, signal.SIGKILL)


def _session_processes(session_dir: str) -> list[int]:
    """Running processes that name the session directory on their command line or hold a file in it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not _is_running(int(entry.name)):
            continue
        try:
            if session_dir.encode() in (entry / "cmdline").read_bytes() or any(
                os.readlink(fd).startswith(session_dir + "/") for fd in (entry / "fd").iterdir()
            ):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _wait_gone(agents: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {title: pid for title, pid in agents.items() if _is_running(pid)}
        if not left:
            return left
        time.sleep(0.1)
    return left


NESTED = """
from tandemrl.cluster.reaper import start_reaper

start_reaper().stdin.close()  # as if the run ended at once: the reaper reaps, then exits
print(__import__("os").environ["TANDEM_RUN_ID"], flush=True)
"""


def test_a_run_started_inside_another_runs_tree_reaps_only_its_own():
    """A `tandem train` whose environment carries another run's id and main pid (here a process of that
    run, as a script the run launched would be) takes a fresh id: its reaper leaves the outer run's
    processes alone. With the inherited id, the reaper of a nested run stopped the shell script that had
    started it (a default-suite test that ran `tandem train` after one had run in-process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TANDEM_RUN_ID": "outer-run", "TANDEM_RUN_PID": "1"}
    outer = subprocess.Popen(["sleep", "600"], env=env)  # a process of the outer run
    try:
        nested = subprocess.run(
            [sys.executable, "-c", NESTED], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert nested.returncode == 0, nested.stderr
        inner_id = nested.stdout.strip()
        assert inner_id and inner_id != "outer-run"
        # the reaper is done once no process carries the inner id (its own reap ended with it)
        _wait(lambda: not tagged_pids(inner_id), 60, "the nested run's reaper to finish")
        time.sleep(GRACE_S + 1)  # past the SIGKILL a wrongly tagged reaper would have sent
        assert outer.poll() is None, "the nested run's reaper stopped a process of the outer run"
    finally:
        outer.kill()
        outer.wait()


def test_an_id_given_to_a_run_is_kept():
    """`TANDEM_RUN_ID` alone names the run (what tests/integration/test_faults.py uses to find its
    processes); so does a second run in one process."""
    code = (
        NESTED
        + 'start_reaper().stdin.close()\nprint(__import__("os").environ["TANDEM_RUN_ID"], flush=True)\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_RUN_PID"}
    env.update(PYTHONPATH=str(REPO), TANDEM_RUN_ID="named-run")
    nested = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert nested.returncode == 0, nested.stderr
    assert nested.stdout.split() == ["named-run", "named-run"]
