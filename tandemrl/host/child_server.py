"""A `tandem` HTTP server run as a child process: spawn, wait for `/health`, stop.

The engine, the SGLang server and the retrieval server are all launched this way (one process each).
Invariants: `start()` (= `launch()` + `wait_healthy()`) returns only once `/health` answers, and
otherwise raises with the tail of the child's log, so a bad path or an out-of-memory error is readable
where it happened; `stop()` always reaps the child (terminate, then kill). No server outlives its
owner even when the owner is killed: the child gets a parent-death signal (SIGKILL when the thread that
launched it dies, so launch from a thread that lives as long as the server), and it runs in its own
session, so a Ctrl-C in the terminal reaches only the owner, which stops the servers in order.
See docs/DESIGN.md (process lifecycle).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tandemrl.host.cpus import id_ranges, pin_child
from tandemrl.host.http_guard import PORT_IN_USE_EXIT
from tandemrl.host.startup import STARTUP_NAME_ENV, mark

log = logging.getLogger(__name__)

# every process of a run carries its id (set by cluster/reaper.py); files a run leaves in the temp
# directory are named by it, so the reaper of a later run can tell whose they were
RUN_ID_ENV = "TANDEM_RUN_ID"
# the pid of the run's main process, beside its id: a process that finds both and is not that pid was
# started inside the run's tree, so a run it starts is one of its own (cluster/reaper.py start_reaper)
RUN_PID_ENV = "TANDEM_RUN_PID"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


PR_SET_PDEATHSIG = 1
# relaunches on a fresh port when the one `free_port` picked was taken before the child bound it
# (an outgoing connection can get it as its source port in between)
PORT_RETRIES = 3


def die_with_parent() -> None:
    """`preexec_fn` of a child: SIGKILL it when its parent (thread) dies, even by kill -9."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ChildServer:
    """Subclasses set `name` and implement `server_args()` (the `tandem` subcommand and its flags)."""

    name = "server"

    def __init__(
        self,
        port: int | None,
        host: str,
        startup_timeout_s: float,
        log_path: str | Path | None,
        env: dict | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.is_port_ours = not port  # a port we picked may be picked again; one the user gave may not
        self.port_retries = 0
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self._log_path = Path(log_path) if log_path else None
        self._temp_log_dir: Path | None = None  # made on first use when no log path was given
        self.proc: subprocess.Popen | None = None
        self._launched_s = 0.0
        self.timeline_name: str | None = None  # its name on the start-up timeline (default: `name`)
        self.cpus: tuple[int, ...] = ()  # the cores it runs on (cluster/cpus.py); (): its parent's

    @property
    def log_path(self) -> Path:
        """The server's log: the path given (a run's servers log under its output directory,
        cluster/server_supervisor.py), else a private temp directory removed at a clean stop."""
        if self._log_path is None:
            self._temp_log_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{self.name.replace(' ', '-')}-"))
            self._log_path = self._temp_log_dir / "log"
        return self._log_path

    @log_path.setter
    def log_path(self, path: str | Path) -> None:
        self._log_path = Path(path)

    def server_args(self) -> list[str]:
        raise NotImplementedError

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tandemrl.cli", *self.server_args()]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self):
        return self.launch().wait_healthy()

    def launch(self):
        """Spawn the child without waiting for it (several servers boot concurrently)."""
        if self.is_alive():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        name = self.timeline_name or self.name
        env = {**os.environ, **OFFLINE_ENV, STARTUP_NAME_ENV: name, **(self.env or {})}
        mark(f"{name} launch started")
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=self._preexec if sys.platform == "linux" else None,
            )
        self._launched_s = time.monotonic()
        if self.cpus:
            log.info("%s runs on cores %s", name, id_ranges(os.sched_getaffinity(self.proc.pid)))
        return self

    def _preexec(self) -> None:
        """In the child, before the server's program runs: die with the parent; keep to `cpus`."""
        die_with_parent()
        if self.cpus:
            pin_child(self.cpus)

    def wait_healthy(self):
        """Block until `/health` answers (raises with the log's tail if the child exits or times out).
        The child is asked at least once however late this is called: a driver that first waited for a
        slower server (a first vLLM start on a fresh GPU took 247 s) still finds this one healthy."""
        assert self.proc is not None, "launch() first"
        deadline = self._launched_s + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                if self._may_take_another_port():
                    self.port_retries += 1
                    mark(f"{self.timeline_name or self.name}: port {self.port} taken, another picked")
                    self.port = free_port(self.host)
                    self.launch()
                    deadline = self._launched_s + self.startup_timeout_s
                    continue
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} during startup "
                    f"({' '.join(self.command())}); log {self.log_path}:\n{self.log_tail()}"
                )
            if self.health() is not None:
                return self
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"{self.name} at {self.url} not healthy after {self.startup_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _may_take_another_port(self) -> bool:
        """The child exited because the port we picked was taken (tandem's servers exit with
        PORT_IN_USE_EXIT then) and retries are left."""
        return (
            self.is_port_ours
            and self.proc.returncode == PORT_IN_USE_EXIT
            and self.port_retries < PORT_RETRIES
        )

    def health(self) -> dict | None:
        """The /health body (`{}` when it is not JSON), or None when the server does not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as response:
                body = response.read()
        except (urllib.error.URLError, OSError):
            return None
        try:
            return json.loads(body)
        except ValueError:
            return {}

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server; a temp log goes with it when the stop was ours (a server that died by
        itself keeps its log, which its error message names)."""
        if self.proc is None:
            return
        is_clean = self.proc.poll() is None
        if is_clean:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if is_clean and self._temp_log_dir is not None:
            shutil.rmtree(self._temp_log_dir, ignore_errors=True)
            self._temp_log_dir, self._log_path = None, None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
