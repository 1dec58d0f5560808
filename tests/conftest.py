"""Shared fixtures: the test session's homes, the prepared SmolLM2 and MiniLM, tiny random models.

Homes. At import, before anything reads it, `TANDEM_HOME` points at an empty directory of this session, so
every test and every process a test starts finds nothing prepared, and the user's `~/.cache/tandemrl` is
never read or written. A test that needs the embedded defaults asks for `prepared_home` (SmolLM2 and
MiniLM, prepared once per session into a second temporary home); a test that needs other state builds it
under `tmp_path` and points `TANDEM_HOME` there. Each test must leave the empty home empty: one that
writes there fails, naming what it wrote (the next test would otherwise find it prepared).

With `TANDEM_REQUIRE_EMPTY_HOME=1` (what `.ci/run` sets) the run also fails when `~/.cache/tandemrl` or
the `$TANDEM_HOME` given to pytest has content at the start, or was created or changed by the end.

Area-specific fixtures live next to their tests; this file only holds what several areas share.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's memory monitor kills workers when the *machine* is near full; on a shared CI box other jobs' memory
# would kill a test's tiny workers (the kernel's OOM killer still guards the machine)
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

REQUIRE_EMPTY_HOME_ENV = "TANDEM_REQUIRE_EMPTY_HOME"
# Set by the session that made the empty home: a process a test starts that imports this module (to get
# free_port, say) keeps the home it was given instead of making one of its own.
SESSION_HOME_ENV = "TANDEM_TEST_EMPTY_HOME"
OWNS_EMPTY_HOME = SESSION_HOME_ENV not in os.environ
if OWNS_EMPTY_HOME:
    OUTER_TANDEM_HOME = os.environ.get("TANDEM_HOME")
    EMPTY_HOME = Path(tempfile.mkdtemp(prefix="tandem-empty-home-"))
    os.environ[SESSION_HOME_ENV] = os.environ["TANDEM_HOME"] = str(EMPTY_HOME)
    atexit.register(shutil.rmtree, EMPTY_HOME, True)  # also when the session ends without sessionfinish
    if "VLLM_CACHE_ROOT" not in os.environ:  # vLLM's compile cache would go to the tandem home
        # (rollout/vllm_server.py), which stays empty here: the session gets its own (make test-vllm)
        vllm_cache = tempfile.mkdtemp(prefix="tandem-test-vllm-cache-")
        os.environ["VLLM_CACHE_ROOT"] = vllm_cache
        atexit.register(shutil.rmtree, vllm_cache, True)
else:
    OUTER_TANDEM_HOME = None
    EMPTY_HOME = Path(os.environ[SESSION_HOME_ENV])

from tandemrl.host.child_server import free_port  # noqa: E402,F401  (tests import it from here)
from tests.home_guard import contents, guarded_homes, snapshot, tree_changes  # noqa: E402

_GUARD: dict[Path, dict] = {}  # guarded home -> its snapshot at the session start
_GUARD_REPORT: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(REQUIRE_EMPTY_HOME_ENV) != "1":
        return
    for home in guarded_homes(OUTER_TANDEM_HOME):
        before = snapshot(home)
        present = contents(before)
        if present:
            shown = "\n  ".join(present[:10])
            raise pytest.UsageError(
                f"{REQUIRE_EMPTY_HOME_ENV}=1 but {home} is not empty at the start ({len(present)} entries):\n  "
                f"{shown}\nA test could pass by reading it. Run with HOME and TANDEM_HOME set to fresh empty "
                f"directories (as .ci/run does), or unset {REQUIRE_EMPTY_HOME_ENV}."
            )
        _GUARD[home] = before


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for home, before in _GUARD.items():
        changes = tree_changes(before, snapshot(home))
        if changes:
            shown = "\n  ".join(changes[:30]) + (
                f"\n  ... and {len(changes) - 30} more" if len(changes) > 30 else ""
            )
            _GUARD_REPORT.append(f"{home} was touched by the test run ({len(changes)} changes):\n  {shown}")
    if _GUARD_REPORT and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("randomly"):  # its header line is hidden under -q: say it again
        terminalreporter.write_line(
            f"random order: replay with -p randomly --randomly-seed={config.option.randomly_seed}"
        )
    if _GUARD_REPORT:
        terminalreporter.section(
            f"{REQUIRE_EMPTY_HOME_ENV}=1: a home outside the test session was touched: the run fails",
            red=True,
        )
        for report in _GUARD_REPORT:
            terminalreporter.write_line(report, red=True)
    elif _GUARD:
        terminalreporter.write_line(f"{REQUIRE_EMPTY_HOME_ENV}: untouched: {', '.join(map(str, _GUARD))}")


@pytest.fixture(autouse=True)
def _empty_home_stays_empty(request):
    """Fail the test that leaves anything in the session's empty `TANDEM_HOME` (then empty it again)."""
    yield
    left = contents(snapshot(EMPTY_HOME))
    if not left:
        return
    for entry in EMPTY_HOME.iterdir():
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    pytest.fail(
        f"{request.node.nodeid} (or a process it started) wrote into the empty TANDEM_HOME {EMPTY_HOME}: "
        f"{left[:10]}. A test that needs the embedded defaults asks for the `prepared_home` fixture (or "
        f"passes `minilm_dir` / `smollm2_dir` explicitly); one that needs other state points TANDEM_HOME "
        f"at tmp_path.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def prepared_home_dir() -> Path:
    """The session's prepared home (filled by `smollm2_dir` and `minilm_dir`); removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="tandem-prepared-home-"))
    atexit.register(shutil.rmtree, root, True)  # ~350 MB: gone when the session ends, however it ends
    return root


@pytest.fixture(scope="session")
def smollm2_dir(prepared_home_dir) -> Path:
    """The real SmolLM2-135M-Instruct HF directory, prepared once from its wheel into the prepared home."""
    from tandemrl.data.prepare_model import prepare_model
    from tandemrl.host.home import default_model_dir, tandem_home

    return prepare_model(prepared_home_dir / default_model_dir().relative_to(tandem_home()))


@pytest.fixture(scope="session")
def minilm_dir(prepared_home_dir) -> Path:
    """The MiniLM sentence-transformers directory (the "minilm" encoder), copied once into the prepared
    home. Session- and module-scoped fixtures pass it as the encoder (`encoder=str(minilm_dir)`), since
    they cannot point TANDEM_HOME at the prepared home for just their own tests."""
    from tandemrl.data.prepare_model import prepare_retriever
    from tandemrl.host.home import default_retriever_dir, tandem_home

    return prepare_retriever(prepared_home_dir / default_retriever_dir().relative_to(tandem_home()))


@pytest.fixture
def prepared_home(monkeypatch, prepared_home_dir, smollm2_dir, minilm_dir) -> Path:
    """`TANDEM_HOME` -> the session's prepared home (SmolLM2, MiniLM) for this test and what it starts."""
    monkeypatch.setenv("TANDEM_HOME", str(prepared_home_dir))
    return prepared_home_dir


@pytest.fixture
def refused_addr() -> str:
    """`127.0.0.1:PORT` where nothing listens, for the test's duration: the port is bound without
    listening, so no other process can take it, and every connection to it is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


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


FAKE_CONTROL = """#!/bin/sh
# fake nvidia-cuda-mps-control: records each call; -d creates the control pipe, as the daemon does
if [ "$1" = "-d" ]; then
    [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start: $FAKE_MPS_FAIL" >&2; exit 1; }
    echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_RECORD"
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"
else
    read command
    echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_RECORD"
fi
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch) -> Path:
    """`fake nvidia-cuda-mps-control` first on PATH: a shell script standing in for NVIDIA's MPS control
    binary at its process boundary (tests/unit/test_mps.py, benchmarks/learning tests); returns the file
    where it records each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE_CONTROL)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    return record
