"""A private CUDA MPS daemon for one training run (`cluster.mps: true`).

Without MPS, processes that share a GPU (the actor and an engine under `actor,rollout: 0`) get it in
alternating time slices: while the engine decodes, the actor's kernels wait, and the reverse. Under MPS
their kernels run side by side on the GPU's SMs. `cluster.mps_sm_percent` caps each side's share of
the SMs while the two overlap (the async runner), so that the engine's many small decode kernels do not
stall the actor's large ones; the sync runner never overlaps them and leaves each the whole GPU.
See docs/DESIGN.md (sharing a GPU).

Invariants: the daemon's pipe and log directories are the run's own (a system MPS daemon is left
alone); it starts before any CUDA process of the run, and every such process finds it through
CUDA_MPS_PIPE_DIRECTORY; it is told to quit when the run ends, also on error, and it carries the run's
TANDEM_RUN_ID, so the reaper stops it after a kill -9 (cluster/reaper.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
START_TIMEOUT_S = 20.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be started."""


class MpsDaemon:
    def __init__(self, root: Path):
        self.root = root
        self.env = {PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}
        self.binary: str | None = None

    def start(self) -> MpsDaemon:
        self.binary = shutil.which(CONTROL)
        if self.binary is None:
            raise MpsError(
                f"cluster.mps=true needs {CONTROL} (part of the NVIDIA driver's utilities) on PATH, and it "
                "is not there. Install it, or set cluster.mps=false."
            )
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        done = subprocess.run([self.binary, "-d"], env=env, capture_output=True, text=True, timeout=30)
        control = Path(self.env[PIPE_ENV]) / "control"
        deadline = time.monotonic() + START_TIMEOUT_S
        while done.returncode == 0 and not control.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if done.returncode != 0 or not control.exists():
            raise MpsError(
                f"{CONTROL} -d did not start a daemon (exit {done.returncode}, {done.stderr.strip()!r}; "
                f"log: {self.log_tail()!r}). Check that the GPUs are not in exclusive-process mode with "
                "another MPS daemon of another user, or set cluster.mps=false."
            )
        log.info("MPS daemon started for this run (pipe %s)", self.env[PIPE_ENV])
        return self

    def log_tail(self, num_chars: int = 600) -> str:
        path = Path(self.env[LOG_ENV]) / "control.log"
        return path.read_text(errors="replace")[-num_chars:] if path.is_file() else ""

    def stop(self) -> None:
        """Ask the daemon to quit (it exits once its last client has); never raises."""
        if self.binary is None:
            return
        try:
            subprocess.run(
                [self.binary],
                input="quit\n",
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("could not stop the MPS daemon at %s: %s", self.env[PIPE_ENV], error)
        shutil.rmtree(self.root, ignore_errors=True)
        self.binary = None


def start_for_run(config: TandemConfig) -> MpsDaemon | None:
    """The run's daemon when `cluster.mps` is set (None otherwise); every process started from now on
    inherits its pipe directory through this process's environment (local Ray's workers included)."""
    if not config.cluster.mps:
        return None
    # short: the daemon's socket path must stay under the kernel's 108-byte limit
    daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="tandem-mps-"))).start()
    os.environ.update(daemon.env)
    return daemon


def sm_percent_env(config: TandemConfig, component: str) -> dict[str, str]:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for `component` (actor or rollout) whenever the async runner
    overlaps the two under MPS: its `cluster.mps_sm_percent` cap, else 100 (set explicitly, so that a
    child never inherits the other side's cap); {} when nothing overlaps."""
    cluster = config.cluster
    if not cluster.mps or not config.runner.async_mode:
        return {}
    return {SM_PERCENT_ENV: str(cluster.mps_sm_percent.get(component, 100))}
