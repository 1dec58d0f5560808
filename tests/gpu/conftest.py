"""The GPU suite's share of the empty-home rule (tests/conftest.py): an engine on CUDA files its kernel
choices under `$TANDEM_HOME/cache/kernel_tuning`, which would write into the empty home. In tests/gpu they
go to a directory of this session instead, shared by its engines (so each shape is timed once per session).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def session_tuning_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_tuning")


@pytest.fixture(scope="module", autouse=True)
def session_tuning_cache(session_tuning_dir):
    """`TANDEM_TUNING_CACHE_DIR` -> the session's directory for one module of tests/gpu (set before the
    module's engines or engine processes start; given back after it, so no other test sees it)."""
    from tandemrl.engine.tuning_cache import CACHE_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(session_tuning_dir))
        yield
