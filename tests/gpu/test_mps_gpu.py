"""cluster/mps.py against NVIDIA's real MPS control daemon: a CUDA process started with the run's pipe
directory (and an SM cap) becomes a client of the run's own daemon, and the daemon quits at stop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tandemrl.cluster.mps import LOG_ENV, SM_PERCENT_ENV, MpsDaemon

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        shutil.which("nvidia-cuda-mps-control") is None, reason="needs nvidia-cuda-mps-control"
    ),
]

CHILD = "import torch; x = torch.ones(1024, 1024, device='cuda'); print(float((x @ x).sum()))"


def test_cuda_child_runs_as_a_client_of_the_runs_daemon():
    daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="tandem-mps-test-"))).start()
    try:
        env = {**os.environ, **daemon.env, SM_PERCENT_ENV: "30"}
        done = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) == 1024.0**3
        log = (Path(daemon.env[LOG_ENV]) / "control.log").read_text()
        assert "client" in log.lower(), log
    finally:
        daemon.stop()
    assert daemon.binary is None
