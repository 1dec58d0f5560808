"""`tandem train` on Ctrl-C: the signal stops the session even where library code swallows a
KeyboardInterrupt, and the run exits 130 with the one interrupted line however it ends after the signal
(tandemrl/commands/train.py). The runs themselves are stubbed in-process: the real Ctrl-C and SIGTERM
of a real run are tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandemrl.commands import train as launch

CONFIG = Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml"


def _args(tmp_path):
    overrides = [f"runner.output_dir={tmp_path / 'run'}", "runner.max_steps=3"]
    return SimpleNamespace(config=str(CONFIG), overrides=overrides, dry_run=False)


def _ctrl_c_swallowed_then(error: BaseException):
    """A run that gets SIGINT where a finalizer swallows the KeyboardInterrupt, then fails with
    `error` (the dropped request of a server the same Ctrl-C stopped)."""

    def fake_train(config, started_s=None):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs here
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the handler did not raise KeyboardInterrupt")
        raise error

    return fake_train


@pytest.fixture
def no_reaper(monkeypatch):
    monkeypatch.setattr("tandemrl.cluster.reaper.start_reaper", lambda: None)


@pytest.mark.parametrize("error", [ConnectionResetError("payload cut"), RuntimeError("engine gone")])
def test_an_error_after_ctrl_c_is_reported_as_the_interrupt(tmp_path, monkeypatch, capsys, no_reaper, error):
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(launch, "train", _ctrl_c_swallowed_then(error))
    assert launch.run_train(_args(tmp_path)) == launch.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.startswith("tandem train: stopped by SIGINT after step 0 of 3;"), err
    assert "no checkpoint to resume from" in err
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back


def test_an_error_without_a_signal_still_raises(tmp_path, monkeypatch, no_reaper):
    def failing_train(config, started_s=None):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(launch, "train", failing_train)
    with pytest.raises(RuntimeError, match="a real bug"):
        launch.run_train(_args(tmp_path))


@pytest.fixture
def interrupt():
    handler = launch.Interrupt()
    previous = signal.signal(signal.SIGINT, handler.handle)
    yield handler
    signal.signal(signal.SIGINT, previous)


def test_a_signal_swallowed_by_library_code_still_stops_the_session(interrupt):
    torn_down: list[bool] = []

    async def session() -> str:
        main_thread = threading.get_ident()
        threading.Timer(0.25, signal.pthread_kill, (main_thread, signal.SIGINT)).start()  # lands in a sleep
        try:
            for _ in range(600):  # 60 s, a hang guard: the signal ends the loop however late it lands
                try:
                    time.sleep(0.1)  # where the handler runs: a KeyboardInterrupt here would be lost
                except KeyboardInterrupt:
                    pass
                await asyncio.sleep(0)
            return "ran to the end: the signal was lost"
        finally:
            torn_down.append(True)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(interrupt.run(session()))
    assert torn_down == [True] and interrupt.received == [signal.SIGINT]
    assert interrupt.task is None


def test_a_second_signal_raises_at_once(interrupt):
    teardown_finished: list[bool] = []

    async def session() -> None:
        try:
            await asyncio.sleep(600)
        finally:  # a teardown that hangs: the second Ctrl-C must still get out
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60.0)
            teardown_finished.append(True)

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        await interrupt.run(session())

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert teardown_finished == []  # the KeyboardInterrupt cut the hanging sleep short
    assert interrupt.received == [signal.SIGINT, signal.SIGINT]


def test_other_commands_end_on_ctrl_c_with_one_line(monkeypatch, capsys):
    from tandemrl import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("tandemrl.commands.evaluate.run_eval", interrupted)
    assert cli.main(["eval", str(CONFIG), "--limit", "1"]) == 130
    assert capsys.readouterr().err == "tandem eval: interrupted; what it started is stopped.\n"
