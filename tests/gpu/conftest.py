"""The GPU suite's share of the empty-home rule (tests/conftest.py): an engine on CUDA files its kernel
choices under `$TANDEM_HOME/cache/kernel_tuning`, which would write into the empty home. They go to a
directory of this session instead, shared by its engines (so each shape is timed once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def session_tuning_cache(tmp_path_factory):
    """`TANDEM_TUNING_CACHE_DIR` -> a session directory, set before any engine (or engine process) starts."""
    from tandemrl.engine.tuning_cache import CACHE_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("kernel_tuning")))
        yield
