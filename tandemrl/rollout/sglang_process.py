"""Launch an SGLang server (`python -m sglang.launch_server`) as a child process for one rollout instance.

The command line comes whole from the config: `rollout.model.model_path`, `rollout.tensor_parallel_size`,
`rollout.sglang.mem_fraction_static`, the host and port of the instance's placement, `rollout.dtype`,
`rollout.max_context_len`, `rollout.max_running_requests`, then `rollout.sglang.extra_args` verbatim.
The GPUs are the ones the process sees (`CUDA_VISIBLE_DEVICES`, set by Ray for the instance's bundle).
Start/health/stop semantics are `ChildServer`'s (SGLang answers `/health` too).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tandemrl.cluster.child_server import ChildServer


class SglangServerProcess(ChildServer):
    name = "SGLang server"

    def __init__(
        self,
        rollout,
        model_path: str | Path,
        host: str,
        port: int,
        seed: int,
        log_path: str | Path | None = None,
    ):
        super().__init__(port, host, rollout.startup_timeout_s, log_path)
        self.rollout, self.model_path, self.seed = rollout, str(model_path), seed

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", *self.server_args()]

    def server_args(self) -> list[str]:
        rollout = self.rollout
        args = [
            "--model-path",
            self.model_path,
            "--tp-size",
            str(rollout.tensor_parallel_size),
            "--mem-fraction-static",
            str(rollout.sglang.mem_fraction_static),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--context-length",
            str(rollout.max_context_len),
            "--max-running-requests",
            str(rollout.max_running_requests),
            "--random-seed",
            str(self.seed),
        ]
        if rollout.dtype != "auto":
            args += ["--dtype", rollout.dtype]
        return args + list(rollout.sglang.extra_args)
