"""Shared fixtures: the prepared SmolLM2 directory and tiny random models built from a config.

Area-specific fixtures live next to their tests; this file only holds what several areas share.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's memory monitor kills workers when the *machine* is near full; on a shared CI box other jobs' memory
# would kill a test's tiny workers (the kernel's OOM killer still guards the machine)
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

from tandemrl.cluster.child_server import free_port  # noqa: E402,F401  (tests import it from here)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct HF directory, prepared once under $TANDEM_HOME."""
    from tandemrl.data.prepare_model import prepare_model

    return prepare_model()


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process engine + HF on a shared 2-core machine: one thread avoids OpenMP oversubscription
    (a module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_dir):
    from tests.tiny_models import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny_models")

    def make(arch: str = "llama", seed: int = 0) -> Path:
        return make_tiny_model_dir(root / f"{arch}-{seed}", smollm2_dir, arch=arch, seed=seed)

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen2")
