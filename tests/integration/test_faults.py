"""Faults of a real `tandem train` process (the CLI, run as a subprocess like a user would): kill -9 of
the main process, of the engine and of the retrieval server, Ctrl-C, and SIGTERM. After each, no
process of the run is left (every process the run starts carries its TANDEM_RUN_ID, which the test
sets), and the next run on the same index starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tandemrl.cluster.reaper import tagged_pids
from tests.integration.runner_helpers import small_kb_once, tiny_overrides

CONFIG = Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml"


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


class Run:
    """`tandem train` in its own session (so a group signal acts like Ctrl-C in its terminal)."""

    def __init__(self, tmp_path: Path, model_dir: Path, small_kb, *extra: str):
        kb_dir, index_dir = small_kb
        self.run_id = uuid.uuid4().hex
        self.output_dir = tmp_path / f"run-{self.run_id[:8]}"
        overrides = tiny_overrides(model_dir, kb_dir, index_dir, self.output_dir)
        overrides += ["runner.max_steps=50", "runner.val_interval=0", *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandemrl.cli", "train", str(CONFIG), *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # faulthandler: a run that does not stop in time is sent SIGABRT (`finish`), and its stderr then
            # holds every thread's stack: where it hung
            env={  # the id named for this run (none inherited from a run this session ran in-process)
                **{k: v for k, v in os.environ.items() if k != "TANDEM_RUN_PID"},
                "TANDEM_RUN_ID": self.run_id,
                "PYTHONPATH": os.getcwd(),
                "PYTHONFAULTHANDLER": "1",
            },
        )

    def wait_first_step(self, timeout_s: float = 300.0) -> None:
        metrics = self.output_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout_s
        while not (metrics.exists() and metrics.read_text().strip()):
            assert self.proc.poll() is None, f"the run exited early:\n{self.proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "no first step in time"
            time.sleep(0.5)
        assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1

    def pids_of(self, subcommand: str) -> list[int]:
        return [p for p in tagged_pids(self.run_id) if subcommand in Path(f"/proc/{p}/cmdline").read_text()]

    def finish(self, timeout_s: float = 60.0) -> tuple[int, str]:
        try:
            _, stderr = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGABRT)  # faulthandler writes every thread's stack to stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.communicate(timeout=30)  # reads stderr while the stacks are written
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the run, if still there, and what it started
            _, stderr = self.proc.communicate()  # all of stderr, the part read above included
            pytest.fail(f"the run did not stop within {timeout_s:.0f} s; its stacks then:\n{stderr[-12000:]}")
        return self.proc.returncode, stderr

    def assert_nothing_left(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while tagged_pids(self.run_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {
            p: Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120]
            for p in tagged_pids(self.run_id)
        }
        assert not left, f"processes of the run left behind: {left}"


def test_kill_9_of_train_leaves_nothing_then_the_next_run_stops_cleanly_on_ctrl_c(
    tmp_path, tiny_llama_dir, small_kb
):
    first = Run(tmp_path, tiny_llama_dir, small_kb, "cluster.use_ray=true")
    first.wait_first_step()
    assert first.pids_of("serve-retrieval") and first.pids_of("serve-engine")
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    first.assert_nothing_left()  # the retrieval server, the engine and Ray's processes

    second = Run(tmp_path, tiny_llama_dir, small_kb, "cluster.use_ray=true")  # same index: its lock is free
    second.wait_first_step()
    os.killpg(second.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
    code, stderr = second.finish()
    assert code == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-2:]
    assert any(line.startswith("tandem train: stopped by SIGINT after step ") for line in last), last
    assert "Traceback" not in stderr and "died" not in stderr, stderr[-3000:]
    second.assert_nothing_left()


@pytest.mark.parametrize(
    ("use_ray", "signum", "to_group"),
    [
        ("true", signal.SIGTERM, False),  # a scheduler's SIGTERM: ray.init sets its own handler, ours stays
        ("false", signal.SIGINT, True),  # Ctrl-C of a run whose actor trains in the driver process
    ],
)
def test_a_signal_stops_the_run_cleanly(tmp_path, tiny_llama_dir, small_kb, use_ray, signum, to_group):
    run = Run(tmp_path, tiny_llama_dir, small_kb, f"cluster.use_ray={use_ray}")
    run.wait_first_step()
    (os.killpg if to_group else os.kill)(run.proc.pid, signum)
    code, stderr = run.finish()
    assert code == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-2:]
    name = signal.Signals(signum).name
    assert any(line.startswith(f"tandem train: stopped by {name} after step ") for line in last), last
    assert "Traceback" not in stderr, stderr[-3000:]
    run.assert_nothing_left()


@pytest.mark.parametrize(
    ("subcommand", "name"),
    [
        ("serve-engine", "rollout engine 0"),
        # the same watchdog and exit path; `make test-slow` (make test stays under 25 min on CI)
        pytest.param("serve-retrieval", "retrieval server", marks=pytest.mark.slow),
    ],
)
def test_kill_9_of_a_server_stops_the_run_naming_it(tmp_path, tiny_llama_dir, small_kb, subcommand, name):
    run = Run(tmp_path, tiny_llama_dir, small_kb)  # cluster.use_ray=false: the servers are the run's children
    run.wait_first_step()
    (pid,) = run.pids_of(subcommand)
    os.kill(pid, signal.SIGKILL)
    code, stderr = run.finish()
    assert code == 1, stderr[-3000:]
    assert f"tandem train: {name} at http://127.0.0.1:" in stderr and "died (exit code -9)" in stderr
    run.assert_nothing_left()
