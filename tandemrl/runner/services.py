"""The processes a run needs: rollout engines and the retrieval server, plus the engine watchdog.

Invariants: services start in order and stop in reverse, also on error; an engine that dies stops
the run within `runner.engine_health_interval_s` (+ one check) with a message naming it, while a
retrieval outage is left to the search tool (retries, then an error text to the agent, SPEC §9).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from tandemrl.config.schema import ConfigError

log = logging.getLogger(__name__)

NUM_HEALTH_FAILURES = 3  # consecutive failed /health checks of an external engine before it counts as dead


class EngineDiedError(RuntimeError):
    """A rollout engine process exited, or an external engine stopped answering /health."""


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def model_path(config: Any) -> str:
    from tandemrl.data.home import default_model_dir

    path = Path(config.rollout.model.model_path or default_model_dir())
    if not path.is_dir():
        raise ConfigError(
            f"rollout.model.model_path={str(path)!r} is not a directory. Run `tandem prepare model` "
            "for the embedded SmolLM2, or point it at a Hugging Face model directory."
        )
    return str(path)


def external_engine_api_key(rollout: Any) -> str | None:
    """The key of external engines: rollout.api_key, else $TANDEM_ENGINE_API_KEY, else $SGLANG_API_KEY."""
    from tandemrl.engine.http_guard import ENGINE_KEY_ENV, SGLANG_KEY_ENV, key_from_env

    return rollout.api_key or key_from_env(ENGINE_KEY_ENV, SGLANG_KEY_ENV)


def search_api_key(search: Any) -> str | None:
    from tandemrl.engine.http_guard import RETRIEVAL_KEY_ENV, key_from_env

    return search.api_key or key_from_env(RETRIEVAL_KEY_ENV)


class Services:
    def __init__(self, config: Any):
        self.config = config
        self.engine_processes: list[Any] = []
        self.engine_urls: list[str] = []
        self.engine_api_key: str | None = None  # what the run's engine clients send (never logged)
        self.retrieval: Any = None
        self.search_addr = config.tools.search.server_addr

    def start(self) -> Services:
        try:
            self._start_retrieval()
            self._start_engines()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_engines(self) -> None:
        rollout = self.config.rollout
        if rollout.server_addrs:
            self.engine_urls = [a if a.startswith("http") else f"http://{a}" for a in rollout.server_addrs]
            self.engine_api_key = external_engine_api_key(rollout)
            log.info("using external %s engines: %s", rollout.backend, ", ".join(self.engine_urls))
            return
        if rollout.backend != "embedded":
            raise ConfigError(
                f"rollout.backend={rollout.backend!r} needs rollout.server_addrs (the URLs of the "
                "running servers); tandem launches only the embedded engine itself."
            )
        from tandemrl.engine.http_guard import new_api_key
        from tandemrl.rollout.engine_process import EngineProcess

        self.engine_api_key = new_api_key()  # fresh per run: only this run's clients control its engines
        device = resolve_device(rollout.device)
        for index in range(rollout.instances):
            process = EngineProcess.from_rollout(
                rollout,
                model_path(self.config),
                device,
                resolve_dtype(rollout.dtype, device),
                self.config.runner.seed + index,
                api_key=self.engine_api_key,
            )
            self.engine_processes.append(process)
            process.start()
            self.engine_urls.append(process.url)
            log.info("rollout engine %d serving at %s", index, process.url)

    def _start_retrieval(self) -> None:
        if not self.config.retrieval.launch:
            log.info("retrieval.launch=false: using the retrieval server at %s", self.search_addr)
            return
        from tandemrl.data.home import default_index_dir
        from tandemrl.retrieval.server_process import RetrievalServerProcess

        index_dir = Path(self.config.retrieval.index_dir or default_index_dir())
        if not index_dir.exists():
            raise ConfigError(
                f"retrieval.index_dir={str(index_dir)!r} does not exist. Build it with `tandem "
                "prepare all` (embedded KB) or `tandem index build`, or set retrieval.launch=false "
                "and tools.search.server_addr to a running retrieval server."
            )
        self.retrieval = RetrievalServerProcess(str(index_dir), mode=self.config.retrieval.mode)
        self.retrieval.start()
        self.search_addr = self.retrieval.addr
        log.info("retrieval server serving %s at %s", index_dir, self.search_addr)

    def check_engines(self) -> None:
        for index, process in enumerate(self.engine_processes):
            if not process.is_alive():
                code = process.proc.returncode if process.proc is not None else None
                raise EngineDiedError(
                    f"rollout engine {index} at {process.url} died (exit code {code}); stopping the run. The last "
                    f"checkpoint (if any) can be resumed with runner.resume_from. End of its log:\n"
                    f"{process.log_tail(2000)}"
                )

    async def watchdog(self, clients: list[Any]) -> None:
        """Runs beside the runner; raises `EngineDiedError` as soon as an engine is gone."""
        interval_s = self.config.runner.engine_health_interval_s
        failures = [0] * len(clients)
        while True:
            self.check_engines()
            if not self.engine_processes:  # external engines: only their /health can tell
                for index, client in enumerate(clients):
                    try:
                        is_healthy = await asyncio.wait_for(client.health(), timeout=max(1.0, interval_s))
                    except Exception:
                        is_healthy = False
                    failures[index] = 0 if is_healthy else failures[index] + 1
                    if failures[index] >= NUM_HEALTH_FAILURES:
                        raise EngineDiedError(
                            f"rollout engine {index} at {self.engine_urls[index]} failed "
                            f"{NUM_HEALTH_FAILURES} health checks in a row; stopping the run."
                        )
            await asyncio.sleep(interval_s)

    def stop(self) -> None:
        for process in reversed(self.engine_processes):
            try:
                process.stop()
            except Exception as error:
                log.warning("stopping engine %s failed: %r", process.url, error)
        if self.retrieval is not None:
            try:
                self.retrieval.stop()
            except Exception as error:
                log.warning("stopping the retrieval server failed: %r", error)
