"""A trainer whose engine dies in the middle of a weight-sync call still ends. A call that waits on the
engine's side of the group (its rendezvous, a broadcast) blocks until the group's timeout (600 s) when that
side is gone, and Python joins the executors' threads at exit: `tests/integration/test_faults.py` caught a
`tandem train` that printed its engine's death and then did not end, its main thread joining a pool thread
still in a weight broadcast.
- The rendezvous runs on a daemon thread (`engine/weight_transport.run_in_daemon_thread`), which the exit
  leaves behind. Here the trainer side is a real `WeightSender` in its own process, forming a real gloo group
  over a real TCPStore; the engine is a fake client (`FakeDyingEngine`, at the HTTP boundary) that answers
  its TP size and then fails the join as an engine killed mid-join does, so the rendezvous never completes.
- A broadcast stays on a pool thread (gloo raising in a daemon thread while the interpreter exits aborts the
  process), and `tandem train`, once it has printed the death, arms its exit guard (runner/exit_guard.py),
  which ends the process if such a thread still holds it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from tandemrl.rollout.client import EngineError
    from tandemrl.rollout.weight_sync import WeightSender

    class FakeDyingEngine:
        '''Stands for an engine's HTTP client: it reports TP 1, then its process dies during the join.'''

        async def num_tp_ranks(self, default):
            return default

        async def init_weights_update_group(self, *args):
            await asyncio.sleep(0.2)
            raise EngineError("rollout engine 0 died (fake)")

    async def main():
        sender = WeightSender([FakeDyingEngine()], backend="gloo")
        try:
            await sender.connect()
        except EngineError as error:
            print(f"connect failed: {error}", flush=True)
            sys.exit(7)
        sys.exit(1)  # the join cannot succeed

    asyncio.run(main())
    """
)


def run_script(path, text: str) -> subprocess.CompletedProcess:
    """`text` as a Python process of its own. The bound only turns a hang into a failure: the process ends
    within seconds, or waits 600 s."""
    path.write_text(text)
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_trainer_ends_when_its_engine_dies_during_the_group_join(tmp_path):
    proc = run_script(tmp_path / "trainer.py", TRAINER)
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert "connect failed: rollout engine 0 died (fake)" in proc.stdout


REPORTER = textwrap.dedent(
    """
    import sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from tandemrl.commands.train import _report_stopped
    from tandemrl.runner import exit_guard

    exit_guard.enable()  # as the `tandem` command does
    gone = threading.Event()  # never set: the server this thread waits on is dead
    ThreadPoolExecutor(1).submit(gone.wait)  # a pool thread, as a weight broadcast runs on
    from tandemrl.runner.services import ServiceDiedError
    error = ServiceDiedError("rollout engine 0 at http://127.0.0.1:1 died (exit code -9); stopping the run.")
    sys.exit(_report_stopped(error))
    """
)


def test_tandem_train_ends_after_a_death_though_a_thread_still_waits(tmp_path):
    proc = run_script(tmp_path / "reporter.py", REPORTER)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert (
        lines[0]
        == "tandem train: rollout engine 0 at http://127.0.0.1:1 died (exit code -9); stopping the run."
    )
    assert "a server died, and a thread still waits on it; ending now" in lines[-1]
