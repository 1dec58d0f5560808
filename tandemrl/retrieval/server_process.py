"""Run the retrieval server as a child process (`python -m tandemrl.cli serve-retrieval ...`).

Used by the runner, the benchmark and the tests. Invariant: `start()` returns only once `/health`
answers, and raises with the tail of the server's log if the process dies or stays silent; `stop()`
always reaps the child (terminate, then kill), so no server outlives its owner's `with` block.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RetrievalServerProcess:
    def __init__(
        self,
        index_dir: str | Path,
        port: int | None = None,
        mode: str | None = "dense",
        host: str = "127.0.0.1",
        qdrant_url: str | None = None,
        startup_timeout_s: float = 180.0,
        log_path: str | Path | None = None,
    ):
        self.index_dir = Path(index_dir)
        self.port = port or _free_port()
        self.mode = mode
        self.host = host
        self.qdrant_url = qdrant_url
        self.startup_timeout_s = startup_timeout_s
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="tandem-retrieval-")) / "log"
        )
        self._process: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        """`host:port`, the form of `tools.search.server_addr`."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "tandemrl.cli",
            "serve-retrieval",
            "--index",
            str(self.index_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.mode:
            cmd += ["--mode", self.mode]
        if self.qdrant_url:
            cmd += ["--qdrant-url", self.qdrant_url]
        return cmd

    def start(self) -> RetrievalServerProcess:
        if self.is_alive():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"retrieval server exited with code {self._process.returncode} during startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.health() is not None:
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"retrieval server on {self.addr} not healthy after {self.startup_timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def health(self) -> dict | None:
        """The /health body, or None when the server does not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> RetrievalServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
