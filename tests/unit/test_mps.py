"""cluster/mps.py: the run's private MPS daemon and the SM caps each side gets.

The daemon lifecycle runs against `fake nvidia-cuda-mps-control` (tests/conftest.py `fake_control`), a
shell script standing in for NVIDIA's control binary at its process boundary (this box has no GPU driver):
it records how it was called and creates the control pipe the real one creates. tests/gpu/test_mps_gpu.py runs the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandemrl.cluster.mps import (
    PIPE_ENV,
    SM_PERCENT_ENV,
    MpsDaemon,
    MpsError,
    sm_percent_env,
    start_for_run,
)
from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config


def test_daemon_starts_with_private_dirs_and_quits(fake_control, tmp_path):
    daemon = MpsDaemon(tmp_path / "mps").start()
    pipe = daemon.env[PIPE_ENV]
    assert Path(pipe, "control").exists() and pipe.startswith(str(tmp_path))
    daemon.stop()
    lines = fake_control.read_text().splitlines()
    assert lines == [f"start {pipe} {tmp_path / 'mps' / 'log'}", f"quit {pipe}"]
    assert not (tmp_path / "mps").exists()
    daemon.stop()  # a second stop is a no-op
    assert len(fake_control.read_text().splitlines()) == 2


def test_daemon_errors_name_the_fix(fake_control, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "exclusive mode")
    with pytest.raises(MpsError, match=r"exit 1.*exclusive mode.*cluster.mps=false"):
        MpsDaemon(tmp_path / "mps").start()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control.*not there.*cluster.mps=false"):
        MpsDaemon(tmp_path / "mps2").start()


def test_start_for_run_exports_the_pipe_to_what_the_run_starts(fake_control, monkeypatch):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    assert start_for_run(load_config(None, [])) is None and PIPE_ENV not in os.environ
    daemon = start_for_run(load_config(None, ["cluster.mps=true"]))
    try:
        assert os.environ[PIPE_ENV] == daemon.env[PIPE_ENV]
    finally:
        daemon.stop()
        monkeypatch.delenv(PIPE_ENV)


def test_sm_caps_apply_only_where_the_runner_overlaps_the_two():
    caps = ["cluster.mps=true", "cluster.mps_sm_percent={actor: 70, rollout: 30}"]
    overlapped = load_config(None, [*caps, "runner.async_mode=true", "agentloop.task_name=searchr1"])
    assert sm_percent_env(overlapped, "actor") == {SM_PERCENT_ENV: "70"}
    assert sm_percent_env(overlapped, "rollout") == {SM_PERCENT_ENV: "30"}
    one_side = load_config(
        None,
        [
            "cluster.mps=true",
            "cluster.mps_sm_percent.actor=60",
            "runner.async_mode=true",
            "agentloop.task_name=searchr1",
        ],
    )
    assert sm_percent_env(one_side, "rollout") == {SM_PERCENT_ENV: "100"}  # explicit: never inherited
    assert sm_percent_env(load_config(None, [*caps, "runner.async_mode=false"]), "actor") == {}
    assert (
        sm_percent_env(load_config(None, ["runner.async_mode=true", "agentloop.task_name=searchr1"]), "actor")
        == {}
    )


def _async_mps_config(*overrides: str):
    """An async run without Ray under the run's MPS daemon, plus `overrides`."""
    base = [
        "runner.async_mode=true",
        "agentloop.task_name=searchr1",
        "cluster.use_ray=false",
        "cluster.mps=true",
    ]
    return load_config(None, [*base, *overrides])


def test_engine_server_gets_its_cap(tmp_path):
    from tandemrl.cluster.placement import plan_placement
    from tandemrl.runner.services import Services

    model = tmp_path / "model"
    model.mkdir()
    config = _async_mps_config(
        "cluster.mps_sm_percent.rollout=35",
        f"rollout.model.model_path={model}",
        "retrieval.launch=false",
        "tools.search.server_addr=127.0.0.1:1",
    )
    local, _ = Services(config, plan_placement(config))._specs()
    engines = [spec for _, spec, _ in local if spec.kind == "embedded"]
    assert engines and all(spec.env == {SM_PERCENT_ENV: "35"} for spec in engines)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.mps_sm_percent.actor=50"], "cluster.mps_sm_percent=.*cluster.mps is false"),
        (["cluster.mps=true", "cluster.mps_sm_percent.engine=50"], "mps_sm_percent.engine=50"),
        (["cluster.mps=true", "cluster.mps_sm_percent.rollout=0"], "from 1 to 100"),
        (["cluster.mps=true", "cluster.mps_sm_percent.actor=101"], "from 1 to 100"),
        (["cluster.mps=true", "cluster.ray_address=auto"], "on every node before `ray start`"),
    ],
)
def test_mps_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_train_stops_its_daemon_and_gives_the_environment_back_on_error(fake_control, tmp_path, monkeypatch):
    from tandemrl.commands.train import train

    for key in (PIPE_ENV, SM_PERCENT_ENV):
        monkeypatch.delenv(key, raising=False)
    index = tmp_path / "index"  # present, so that the check after it (the model's) is the one that fails
    index.mkdir()
    (index / "index.json").write_text("{}")
    config = _async_mps_config(
        "cluster.mps_sm_percent.actor=60",
        f"retrieval.index_dir={index}",
        f"rollout.model.model_path={tmp_path / 'no-such-model'}",
        f"runner.output_dir={tmp_path / 'run'}",
    )
    with pytest.raises(ConfigError, match="no-such-model"):
        train(config, write_plots=False)
    assert [line.split()[0] for line in fake_control.read_text().splitlines()] == ["start", "quit"]
    assert PIPE_ENV not in os.environ and SM_PERCENT_ENV not in os.environ
