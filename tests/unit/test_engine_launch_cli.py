"""A launched vLLM (or SGLang) server through the user's path: `tandem config show`, then `tandem train
--dry-run`, then `tandem train`'s own refusal, run as the `tandem` command (issue 37). tandem accepts
`rollout.backend=vllm` without `rollout.server_addrs` wherever the interpreter the launch runs
(`rollout.vllm.python`, with `rollout.vllm.pythonpath` first on its PYTHONPATH) imports vllm, and refuses
in one line naming that interpreter, what the import said, and the keys that change it where it cannot.

vLLM is not installed in the suite's environment: the engine here is FAKE_VLLM, a fake `vllm` package
(an empty module, written below) put on the path of the launch's interpreter, either by
`rollout.vllm.pythonpath` or by a stand-in interpreter (a shell script that runs this Python with the
fake first on PYTHONPATH). Nothing is launched: the dry run prints the command, and the real train
refuses before it starts a service.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/searchr1/config/smollm2_h200_async.yaml"
# this machine has no NVIDIA driver utilities, which the recipe's cluster.mps needs (checked apart)
NO_MPS = ["cluster.mps=false"]
FAKE_VLLM = '"""A FAKE vllm package for tests/unit/test_engine_launch_cli.py: importing it succeeds."""\n'


def _tandem(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)  # the suite's own path must not reach the launch's interpreter
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def _show(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`tandem config show` of the recipe with `overrides`."""
    return _tandem(tmp_path, "config", "show", str(RECIPE), *overrides)


def _fake_engine(tmp_path: Path, name: str = "vllm", body: str = FAKE_VLLM) -> Path:
    site = tmp_path / f"fake-{name}-site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(body)
    return site


def _stand_in_python(tmp_path: Path, site: Path) -> Path:
    """A stand-in interpreter: this Python with the fake package first on its path."""
    script = tmp_path / "python-with-fake-vllm"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script


def _one_line_refusal(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.mark.parametrize("route", ["pythonpath", "python"])
def test_launched_vllm_passes_config_show_and_dry_run_where_its_interpreter_imports_vllm(tmp_path, route):
    site = _fake_engine(tmp_path)
    if route == "pythonpath":
        keys = [f"rollout.vllm.pythonpath=[{site}]"]
    else:
        keys = [f"rollout.vllm.python={_stand_in_python(tmp_path, site)}"]
    overrides = ["rollout.backend=vllm", *NO_MPS, *keys]

    shown = _show(tmp_path, *overrides)
    assert shown.returncode == 0, shown.stderr
    assert "backend: vllm" in shown.stdout
    assert "pause_mode: in_place" in shown.stdout  # the recipe's, and vLLM's keep

    planned = _tandem(tmp_path, "train", str(RECIPE), "--dry-run", *overrides)
    assert planned.returncode == 0, planned.stderr
    command = next(
        line for line in planned.stdout.splitlines() if line.startswith("rollout engine 0 command")
    )
    assert "-m vllm.entrypoints.openai.api_server" in command
    if route == "pythonpath":
        assert f"PYTHONPATH={site}" in command and sys.executable in command
    else:
        assert command.split("<the run's API key> ")[1].startswith(keys[0].split("=", 1)[1])


def test_launched_vllm_is_refused_in_one_line_where_it_does_not_import(tmp_path):
    """The suite's interpreter has no vllm: config show and train refuse the same way, naming the
    interpreter, what `import vllm` said, and both keys; train starts nothing."""
    for argv in (["config", "show", str(RECIPE)], ["train", str(RECIPE)]):
        result = _tandem(tmp_path, *argv, "rollout.backend=vllm", *NO_MPS)
        _one_line_refusal(
            result,
            sys.executable,
            "No module named 'vllm'",
            "rollout.vllm.python",
            "rollout.vllm.pythonpath",
            "rollout.server_addrs",
        )
    assert not (tmp_path / "home" / "runs").exists()


def test_a_broken_engine_install_and_a_missing_interpreter_are_named(tmp_path):
    broken = _fake_engine(
        tmp_path, body='raise ImportError("libcudart.so.13: cannot open shared object file")\n'
    )
    result = _show(tmp_path, "rollout.backend=vllm", *NO_MPS, f"rollout.vllm.pythonpath=[{broken}]")
    _one_line_refusal(result, "libcudart.so.13: cannot open shared object file", f"PYTHONPATH {broken} first")
    missing = tmp_path / "no-such-python"
    result = _show(tmp_path, "rollout.backend=vllm", *NO_MPS, f"rollout.vllm.python={missing}")
    _one_line_refusal(result, str(missing), "cannot run")


def test_launched_sglang_takes_the_same_check(tmp_path):
    """The same gap for SGLang (launched as Ray actors): its interpreter must import sglang."""
    overrides = ["rollout.backend=sglang", "cluster.use_ray=true", *NO_MPS]
    result = _show(tmp_path, *overrides)
    _one_line_refusal(
        result, "No module named 'sglang'", "rollout.sglang.python", "rollout.sglang.pythonpath"
    )
    site = _fake_engine(tmp_path, "sglang")
    result = _show(tmp_path, *overrides, f"rollout.sglang.pythonpath=[{site}]")
    assert result.returncode == 0, result.stderr


def test_external_servers_need_no_engine_here(tmp_path):
    """With rollout.server_addrs tandem launches nothing, so nothing is imported."""
    result = _show(tmp_path, "rollout.backend=vllm", *NO_MPS, "rollout.server_addrs=[127.0.0.1:8000]")
    assert result.returncode == 0, result.stderr
