"""The import contract in pyproject.toml (docs/DESIGN.md, "Where things live") bites: `lint-imports` passes
on the package as it is, and fails, naming the broken contract, on a copy of the package with one offending
import added. Each case adds what a hurried change would: an import up a layer, a cycle inside a package,
Ray outside cluster/, torch in config/, the agent importing the engine, the actor importing a rollout
client. `make test` and `make lint` run the same command on the real package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy's tandemrl, not the installed one
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "tandemrl", tmp_path / "tandemrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(root: Path, module: str, line: str) -> None:
    path = root / "tandemrl" / module
    text = path.read_text()
    at = text.index("from __future__ import annotations\n") + len("from __future__ import annotations\n")
    path.write_text(text[:at] + f"\n{line}  # added by the test\n" + text[at:])


def test_the_package_keeps_every_contract(package_copy):
    result = _lint(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("config/errors.py", "import tandemrl.runner.session", "Layers"),  # up from config to runner
        ("host/home.py", "import tandemrl.metrics.logger", "Layers"),  # host is the floor
        ("engine/sampler.py", "import tandemrl.engine.scheduler", "No cycles between siblings"),
        ("agent/prompt.py", "import ray", "Only cluster/ imports Ray"),
        ("config/loader.py", "import torch", "config/ and buffer/ are pure Python"),
        ("agent/loop.py", "import tandemrl.engine.scheduler", "The agent reaches engines over HTTP only"),
        ("trainer/loss.py", "import tandemrl.rollout.client", "The actor knows no engine"),
    ],
)
def test_an_offending_import_breaks_its_contract(package_copy, module, line, broken):
    if broken == "No cycles between siblings":  # the other half of the cycle: scheduler -> sampler
        scheduler = (package_copy / "tandemrl/engine/scheduler.py").read_text()
        assert "tandemrl.engine.sampler" not in scheduler  # else the test would prove nothing
        _add_import(package_copy, "engine/scheduler.py", "import tandemrl.engine.sampler")
    _add_import(package_copy, module, line)
    result = _lint(package_copy)
    assert result.returncode != 0, result.stdout
    assert f"{broken} BROKEN" in result.stdout, result.stdout
