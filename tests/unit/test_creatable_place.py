"""`host/files.py` `creatable_problem`: the one check train, sft, index build and export make on the folder
they will create, before any work starts."""

from __future__ import annotations

import os

import pytest

from tandemrl.commands.preflight import _check_output_dir
from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.host.files import creatable_problem


@pytest.fixture
def locked(tmp_path, monkeypatch):
    """A directory this user may not write: `os.access` says so (the suite runs as root, where a mode
    would not stop it)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode)
    )
    return locked


def test_a_new_path_under_a_writable_directory_is_fine(tmp_path):
    assert creatable_problem(tmp_path / "a" / "b" / "c") is None
    assert creatable_problem(tmp_path) is None
    assert not (tmp_path / "a").exists()  # nothing is created


def test_a_file_on_the_way_is_named(tmp_path):
    (tmp_path / "f").write_text("mine")
    for path in (tmp_path / "f", tmp_path / "f" / "x" / "y"):
        problem = creatable_problem(path)
        assert problem is not None and repr(str(tmp_path / "f")) in problem and "is a file" in problem
    assert (tmp_path / "f").read_text() == "mine"


def test_an_unwritable_nearest_directory_is_named(tmp_path, locked):
    problem = creatable_problem(locked / "run")
    assert problem is not None and repr(str(locked)) in problem and "not writable" in problem
    assert creatable_problem(tmp_path / "other") is None


def test_a_link_to_nothing_on_the_way_is_named(tmp_path):
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    for path in (tmp_path / "gone", tmp_path / "gone" / "run"):
        problem = creatable_problem(path)
        assert problem is not None and "does not exist" in problem and repr(str(tmp_path / "gone")) in problem


def test_a_name_the_system_refuses_is_named(tmp_path):
    problem = creatable_problem(tmp_path / ("x" * 300) / "run")
    assert problem is not None and "cannot be used" in problem


def test_train_refuses_an_output_dir_it_could_not_write(locked):
    config = load_config(None, [f"runner.output_dir={locked / 'run'}"])
    with pytest.raises(ConfigError, match=r"runner\.output_dir=.*not writable"):
        _check_output_dir(config)
