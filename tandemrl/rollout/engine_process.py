"""Launch `tandem serve-engine` as a subprocess and wait until it answers /health.

Invariant: `start()` either returns with a healthy engine or raises with the tail of the process's
stderr, so a bad model path or an out-of-memory error is readable where it happened.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    def __init__(
        self,
        model_path: str | Path,
        port: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_running_requests: int = 64,
        max_context_len: int = 4096,
        seed: int = 0,
        kv_cache_gb: float | None = None,
        startup_timeout_s: float = 300.0,
        env: dict | None = None,
    ):
        self.model_path = str(model_path)
        self.port = port or _free_port()
        self.device, self.dtype, self.seed = device, dtype, seed
        self.max_running_requests, self.max_context_len = max_running_requests, max_context_len
        self.kv_cache_gb, self.startup_timeout_s = kv_cache_gb, startup_timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "tandemrl.cli",
            "serve-engine",
            "--model",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--max-running-requests",
            str(self.max_running_requests),
            "--max-context-len",
            str(self.max_context_len),
            "--seed",
            str(self.seed),
        ]
        if self.kv_cache_gb is not None:
            cmd += ["--kv-cache-gb", str(self.kv_cache_gb)]
        return cmd

    def start(self) -> EngineProcess:
        self._log = tempfile.NamedTemporaryFile(prefix="tandem-engine-", suffix=".log", delete=False)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(self.env or {})}
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine process exited with code {self.proc.returncode} during startup "
                    f"({' '.join(self.command())}):\n{self.log_tail()}"
                )
            if self._is_healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"engine on port {self.port} not healthy after {self.startup_timeout_s} s:\n{self.log_tail()}"
        )

    def _is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def log_tail(self, num_chars: int = 4000) -> str:
        if self._log is None:
            return ""
        return Path(self._log.name).read_text(errors="replace")[-num_chars:]

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
