"""The import contract of pyproject.toml (`[tool.importlinter]`, docs/DESIGN.md "Where things live") bites.

`make lint` and `make test` run `lint-imports`; these tests run it on a copy of the package, unchanged and
with one import added that breaks a rule, so a contract that stopped checking anything fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> list[str]:
    """The `lint-imports` of this interpreter's environment (the dev extra installs it)."""
    script = Path(sys.executable).with_name("lint-imports")
    assert script.exists(), f"{script} is missing: install the dev extra (`pip install -e '.[dev]'`)"
    return [str(script), "--no-cache"]


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """tandemrl/ and pyproject.toml copied to a fresh directory, which is all `lint-imports` reads."""
    shutil.copytree(ROOT / "tandemrl", tmp_path / "tandemrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _run(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH names the copy alone, so grimp reads the copy, not the installed package
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(_lint_imports(), cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_package_keeps_every_contract(package_copy):
    result = _run(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(package_copy):
    _append(package_copy / "tandemrl" / "config" / "errors.py", "import tandemrl.runner  # noqa: E402")
    result = _run(package_copy)
    assert result.returncode != 0
    assert "Layers BROKEN" in result.stdout
    assert "tandemrl.config is not allowed to import tandemrl.runner" in result.stdout
    assert "tandemrl.config.errors -> tandemrl.runner" in result.stdout


def test_a_cycle_inside_a_package_is_refused(package_copy):
    # runner/records.py is below runner/step.py (step imports it); the reverse import closes a cycle
    _append(package_copy / "tandemrl" / "runner" / "records.py", "import tandemrl.runner.step  # noqa: E402")
    result = _run(package_copy)
    assert result.returncode != 0
    assert "No cycles between siblings BROKEN" in result.stdout


def test_the_actor_may_not_reach_an_engine(package_copy):
    _append(package_copy / "tandemrl" / "trainer" / "loss.py", "import tandemrl.rollout.client  # noqa: E402")
    result = _run(package_copy)
    assert result.returncode != 0
    assert "The actor knows no engine BROKEN" in result.stdout
