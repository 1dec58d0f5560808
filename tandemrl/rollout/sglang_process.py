"""Launch an SGLang server (`python -m sglang.launch_server`) as a child process for one rollout instance.

The command line comes whole from the config: `rollout.model.model_path`, `rollout.tensor_parallel_size`,
`rollout.sglang.mem_fraction_static`, the host and port of the instance's placement, `rollout.dtype`,
`rollout.max_context_len`, `rollout.max_running_requests`, `--incremental-streaming-output` (the client
streams, rollout/client.py, and reads deltas and cumulative chunks alike), `rollout.engine.speculative` (as
SGLang's NGRAM flags, `speculative_args`), then `rollout.sglang.extra_args` verbatim.
The GPUs are the ones the process sees (`CUDA_VISIBLE_DEVICES`, set by Ray for the instance's bundle).
The interpreter is `rollout.sglang.python` (default: tandem's), with `rollout.sglang.pythonpath` first
on its PYTHONPATH (an engine installed aside, for that process only).

The run's API key reaches SGLang as `--api-key` inside a YAML file named by `--config` (SGLang's
`ConfigArgumentMerger` turns its keys into flags), in a directory only this user can read, removed at
stop: never on the command line, which `ps` and error messages show. The directory is named after the
run (`tandem-sglang-key-<run id>-*`): after a kill -9 the run's reaper removes it, and any run's reaper
removes those whose run has no process left (cluster/reaper.py). SGLang itself logs its server arguments,
the key among them, into the server's log (entrypoints/engine.py, `server_args=` at start-up): the log
stays in the run's own `logs/`, the key dies with the run, and the log tails tandem's errors quote name
it as `<api key>` (`log_tail`). Start/health/stop semantics are `ChildServer`'s (SGLang answers `/health`
too).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from tandemrl.host.child_server import ChildServer

KEY_DIR_PREFIX = "tandem-sglang-key-"  # then the owner (cluster/reaper.py removes those of dead owners)


def key_owner() -> str:
    """Who a key directory belongs to: the run (its TANDEM_RUN_ID), else this process (`pid<N>`)."""
    from tandemrl.host.child_server import RUN_ID_ENV

    run_id = os.environ.get(RUN_ID_ENV, "")
    return run_id if run_id.isalnum() else f"pid{os.getpid()}"


def speculative_args(engine) -> list[str]:
    """SGLang's flags for `engine.speculative` (`rollout.engine`, an `EngineOptions`); none without it.
    SGLang 0.5.15's NGRAM drafts from a trie of every request's tokens (no prompt-lookup sizes:
    config/rollout.py refuses others than the defaults) and counts the verified root among its
    --speculative-num-draft-tokens (`get_draft_token_num` is that minus 1), hence the + 1. Its verify
    returns the target model's logprobs for the accepted tokens (`ngram_worker.py` calls
    `compute_spec_v2_logprobs` on the target's logits); read in its source, not run here (CUDA only)."""
    if engine.speculative == "none":
        return []
    assert engine.speculative == "ngram", engine.speculative  # config/engine.py admits no other
    return [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        str(engine.spec_num_draft_tokens + 1),
    ]


def engine_env(pythonpath: list[str]) -> dict[str, str]:
    """The environment an engine server adds to its parent's: `pythonpath` before the inherited one."""
    if not pythonpath:
        return {}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([*pythonpath, *inherited])}


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
        api_key: str | None = None,
    ):
        env = engine_env(rollout.sglang.pythonpath)
        super().__init__(port, host, rollout.startup_timeout_s, log_path, env=env)
        self.rollout, self.model_path, self.seed = rollout, str(model_path), seed
        self.api_key = api_key
        self._secret_dir: Path | None = None

    @property
    def config_path(self) -> Path | None:
        """The key file (None without a key); its private directory is made on first use."""
        if self.api_key is None:
            return None
        if self._secret_dir is None:  # mode 0700, named by its run so the reaper finds it after a kill -9
            self._secret_dir = Path(tempfile.mkdtemp(prefix=f"{KEY_DIR_PREFIX}{key_owner()}-"))
        return self._secret_dir / "args.yaml"

    def command(self) -> list[str]:
        python = self.rollout.sglang.python or sys.executable
        return [python, "-m", "sglang.launch_server", *self.server_args()]

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
            # each streamed chunk carries the tokens (and logprobs) since the last one: by default SGLang
            # 0.5.15 sends every token so far in every chunk (tokenizer_manager.py `_handle_batch_output`),
            # O(n^2) bytes a request, over 15 MB for a 1,024-token response with logprobs
            "--incremental-streaming-output",
        ]
        if rollout.dtype != "auto":
            args += ["--dtype", rollout.dtype]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        return args + speculative_args(rollout.engine) + list(rollout.sglang.extra_args)

    def launch(self):
        if self.config_path is not None and not self.is_alive():
            self._write_config()
        return super().launch()

    def _write_config(self) -> None:
        """The key file: created 0600 (in a 0700 directory) before anything is written to it."""
        path = self.config_path
        assert path is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'api-key: "{self.api_key}"\n')  # token_urlsafe: no character needs escaping

    def log_tail(self, num_chars: int = 4000) -> str:
        """The log's end, for an error message, with the key SGLang logged among its arguments hidden."""
        tail = super().log_tail(num_chars)
        return tail.replace(self.api_key, "<api key>") if self.api_key else tail

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = None
