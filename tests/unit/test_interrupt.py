"""`tandem train` on Ctrl-C: exit 130 with the one interrupted line, however the run ends after the
signal (tandemrl/runner/launch.py). The runs themselves are stubbed in-process: the real Ctrl-C of a
real run is tests/integration/test_faults.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandemrl.runner import launch

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
