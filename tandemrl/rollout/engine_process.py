"""Launch `tandem serve-engine` as a child process and wait until it answers /health.

Invariant (from `ChildServer`): `start()` either returns with a healthy engine or raises with the tail
of the process's log, so a bad model path or an out-of-memory error is readable where it happened.
The API key travels in the child's environment, never on its command line (which `ps` and error
messages show).
"""

from __future__ import annotations

from pathlib import Path

from tandemrl.config.engine import EngineOptions, engine_flags
from tandemrl.host.child_server import ChildServer
from tandemrl.host.http_guard import ENGINE_KEY_ENV, new_api_key


class EngineProcess(ChildServer):
    name = "engine process"

    def __init__(
        self,
        model_path: str | Path,
        port: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_running_requests: int = 64,
        max_context_len: int = 4096,
        seed: int = 0,
        options: EngineOptions | None = None,
        startup_timeout_s: float = 300.0,
        env: dict | None = None,
        log_path: str | Path | None = None,
        api_key: str | None = None,
        weight_update_timeout_s: float = 600.0,
    ):
        # "" clears a key the parent's environment may hold for external engines
        env = {**(env or {}), ENGINE_KEY_ENV: api_key or ""}
        super().__init__(port, "127.0.0.1", startup_timeout_s, log_path, env)
        self.api_key, self.weight_update_timeout_s = api_key, weight_update_timeout_s
        self.model_path = str(model_path)
        self.device, self.dtype, self.seed = device, dtype, seed
        self.max_running_requests, self.max_context_len = max_running_requests, max_context_len
        self.options = options or EngineOptions()

    @classmethod
    def from_rollout(
        cls, rollout, model_path: str | Path, device: str, dtype: str, seed: int, api_key: str | None = None
    ) -> EngineProcess:
        """An engine process for `rollout` (a `RolloutConfig`): every engine setting of that section
        reaches `serve-engine` from here (the run's services and `tandem evaluate` both start engines).
        It gets `api_key`, or a fresh one: only this run's clients (`process.api_key`) can control it."""
        return cls(
            model_path,
            device=device,
            dtype=dtype,
            max_running_requests=rollout.max_running_requests,
            max_context_len=rollout.max_context_len,
            seed=seed,
            options=rollout.engine,
            startup_timeout_s=rollout.startup_timeout_s,
            api_key=api_key or new_api_key(),
            weight_update_timeout_s=rollout.weight_update_timeout_s,
        )

    def server_args(self) -> list[str]:
        args = [
            "serve-engine",
            "--model",
            self.model_path,
            "--host",
            self.host,
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
            "--weight-update-timeout-s",
            str(self.weight_update_timeout_s),
        ]
        return args + engine_flags(self.options)
