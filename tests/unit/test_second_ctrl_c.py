"""A second Ctrl-C ends `tandem train` whatever it waits on (runner/exit_guard.py), and
`runner.weights_check_tokens`, whose unbounded decode kept a stopped run alive, is bounded.

The blocked run is a real `tandem` process (the command's own `main()`), whose `train` is a fake that
stands in for a run stuck after its last step: a non-daemon thread that never ends (the actor's reference
decode under `asyncio.to_thread`) and a teardown that waits for it (as `asyncio.run` waits for its
executor). The signals are real SIGINTs sent to that process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/searchr1/config/embedded_cpu_async.yaml"

FAKE_STUCK_RUN = """
import sys, threading
from tandemrl.commands import train as launch

def fake_train(config, started_s=None):
    '''Fake of a run stuck after its last step: a thread that never ends, a teardown that waits for it.'''
    never = threading.Event()
    stuck = threading.Thread(target=never.wait, name="reference-decode")
    stuck.start()
    try:
        print("blocked", flush=True)
        never.wait()  # as the run waits for the decode
    finally:
        print("tearing down", flush=True)
        if TEARDOWN_WAITS:
            never.wait()  # the teardown waits for it too

TEARDOWN_WAITS = sys.argv[3] == "waits"
launch.train = fake_train
launch.check_startable = lambda config: None
import tandemrl.cluster.reaper
tandemrl.cluster.reaper.start_reaper = lambda: None
from tandemrl.cli import main
sys.argv = ["tandem", "train", sys.argv[1], "runner.output_dir=" + sys.argv[2], "runner.max_steps=3"]
sys.exit(main())
"""


def _blocked_run(tmp_path: Path, teardown: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_STUCK_RUN, str(CONFIG), str(tmp_path / "run"), teardown],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "blocked"
    return proc


def test_a_second_ctrl_c_ends_a_run_blocked_on_a_thread(tmp_path):
    proc = _blocked_run(tmp_path, "waits")
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "tearing down"  # the first one was taken
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a hang detector; before the fix it never returned
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "tandem train: stopped by SIGINT after step 0 of 3" in err
    assert "Traceback" not in err


def test_a_run_that_printed_its_stop_line_ends_though_a_thread_still_runs(tmp_path):
    """One Ctrl-C: the teardown finishes and the stop line is printed, but a non-daemon thread would
    keep the interpreter from exiting (as asyncio's executor thread did)."""
    proc = _blocked_run(tmp_path, "returns")
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "tandem train: stopped by SIGINT after step 0 of 3" in err and "Traceback" not in err


def test_a_signal_while_the_stop_line_is_written_does_not_cut_it():
    from tandemrl.commands.train import Interrupt

    interrupt = Interrupt()
    interrupt.received.append(signal.SIGINT)
    interrupt.is_reporting = True
    try:
        interrupt.handle(signal.SIGINT, None)
    except KeyboardInterrupt:
        pytest.fail("a signal while the stop line is written raised KeyboardInterrupt, cutting the line")
    assert interrupt.received == [signal.SIGINT, signal.SIGINT]


def test_weights_check_tokens_is_bounded():
    with pytest.raises(ConfigError, match=r"runner.weights_check_tokens=5000: must be from 0 to 256"):
        load_config(CONFIG, ["runner.weights_check_tokens=5000"])
    with pytest.raises(
        ConfigError, match=r"weights_check_tokens=200 does not fit rollout.max_context_len=240"
    ):
        load_config(
            CONFIG,
            [
                "runner.weights_check_tokens=200",
                "rollout.max_context_len=240",
                "agentloop.max_response_tokens=200",
                "agentloop.max_new_tokens_per_turn=100",
            ],
        )
    assert load_config(CONFIG, ["runner.weights_check_tokens=256"]).runner.weights_check_tokens == 256


FAKE_DEATH = """
import asyncio, sys, threading, time
from tandemrl.commands.train import STUCK_ON_A_DEATH, _stop_on_a_death
from tandemrl.runner import exit_guard
from tandemrl.runner.services import EngineDiedError

exit_guard.enable()  # as in the `tandem` process
never = threading.Event()

async def fake_session():
    '''Fake of a run whose engine died mid-push: a thread still blocked on the dead peer (a gloo broadcast
    waits out its timeout), and the watchdog's error.'''
    if sys.argv[1] == "stuck":
        asyncio.get_running_loop().run_in_executor(None, never.wait)
    await asyncio.sleep(0.1)
    raise EngineDiedError("rollout engine 0 at http://127.0.0.1:1 died (exit code -9); stopping the run.")

try:
    asyncio.run(_stop_on_a_death(fake_session()))  # as commands/train.py train() runs the session
except EngineDiedError:
    pass
finally:
    exit_guard.disarm(STUCK_ON_A_DEATH)
time.sleep(exit_guard.GRACE_S + 1)  # past the grace: a disarmed guard must not fire
print("ended by itself", flush=True)
"""


@pytest.mark.parametrize("thread", ["stuck", "free"])
def test_a_dead_server_ends_the_run_though_a_thread_still_waits_on_it(thread):
    """The stop line of a dead engine comes within the guard's grace even while `asyncio.run` waits for a
    thread blocked on that engine (before, it waited out the collective's 600 s timeout); when nothing is
    stuck the guard is disarmed and the command ends by itself."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FAKE_DEATH, thread], capture_output=True, text=True, env=env, timeout=120
    )
    if thread == "stuck":
        assert result.returncode == 1, result.stderr
        assert "tandem train: rollout engine 0 at http://127.0.0.1:1 died (exit code -9)" in result.stderr
        assert "a server died, and a thread still waits on it; ending now" in result.stderr
        assert "ended by itself" not in result.stdout
    else:
        assert result.returncode == 0 and "ended by itself" in result.stdout, result.stderr
        assert "ending now" not in result.stderr
