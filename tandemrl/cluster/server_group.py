"""The run's servers placed by the plan: each a `ServerSupervisor`, in the runner's process or as a Ray
actor in a placement group pinned to its node with its GPUs.

Invariants: `launch()` only spawns (every server boots at once, and beside the actor); `wait()`
returns once every server answers `/health`; `status()` answers for every server without blocking on
a dead node (a lost Ray actor counts as a dead server); `stop()` stops every server and frees its
placement group, also after a partial start.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tandemrl.cluster.server_supervisor import ServerSpec, ServerSupervisor

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from tandemrl.cluster.ray_nodes import NodeMap

log = logging.getLogger(__name__)


class ServerHandle:
    """A supervisor where it runs: `local` in this process, else a Ray actor and its placement group."""

    def __init__(
        self,
        name: str,
        spec: ServerSpec,
        supervisor: ServerSupervisor | ActorHandle,
        placement_group: PlacementGroup | None = None,
    ):
        self.name, self.spec = name, spec
        self.supervisor, self.placement_group = supervisor, placement_group
        self.is_remote = placement_group is not None
        self.url: str | None = None
        self.node_id: str | None = None  # the Ray node it landed on (remote only), read back from Ray
        self.pending_launch: ObjectRef | None = None  # a remote launch submitted, its URL not read back yet

    def _call(self, method: str, *args: Any) -> Any:
        if not self.is_remote:
            return getattr(self.supervisor, method)(*args)
        import ray

        return ray.get(getattr(self.supervisor, method).remote(*args))

    def launch(self) -> None:
        """Spawn the server; a remote one is only submitted (its URL arrives with `ServerGroup.wait`)."""
        if not self.is_remote:
            self.url = self.supervisor.launch()
            return
        self.pending_launch = self.supervisor.launch.remote()

    def wait_healthy(self) -> str:
        self.url = self._call("wait_healthy")
        return self.url

    async def status(self) -> tuple[bool, int | None]:
        if not self.is_remote:
            return self.supervisor.status()
        try:
            return await self.supervisor.status.remote()
        except Exception:  # the actor (or its node) is gone: so is its server
            return False, None

    def log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self._call("log_tail", num_chars)
        except Exception as error:
            return f"(no log: {error!r})"

    def stop(self) -> None:
        try:
            self._call("stop")
        except Exception as error:
            log.warning("stopping %s failed: %r", self.name, error)
        if self.is_remote:
            import ray

            ray.kill(self.supervisor)
            ray.util.remove_placement_group(self.placement_group)


def place_remote(name: str, spec: ServerSpec, node: int, num_gpus: float, nodes: NodeMap) -> ServerHandle:
    """A Ray actor supervising `spec` on node rank `node`, in its own placement group of one bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, selectors = nodes.pinned_bundles([node], [num_gpus])
    group = ray.util.placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selectors)
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
    remote_cls = ray.remote(**nodes.remote_options(num_gpus))(ServerSupervisor)
    actor = remote_cls.options(scheduling_strategy=strategy, name=None).remote(
        spec, nodes.num_nodes > 1, True
    )
    return ServerHandle(name, spec, actor, group)


class ServerGroup:
    def __init__(self, handles: list[ServerHandle]):
        self.handles = handles

    def launch(self) -> None:
        """Spawn (or, for remote servers, submit) every server; returns at once."""
        for handle in self.handles:
            handle.launch()

    def wait(self) -> list[str]:
        """Block until every server answers /health (a remote server's launch errors surface here)."""
        from tandemrl.host.startup import mark

        remote = [h for h in self.handles if h.is_remote]
        if remote:
            import ray

            # a Ray actor runs its calls in order: each wait_healthy follows its supervisor's launch
            healthy = [h.supervisor.wait_healthy.remote() for h in remote]
            ray.get([h.pending_launch for h in remote if h.pending_launch is not None])
            for handle, url in zip(remote, ray.get(healthy), strict=True):
                handle.url, handle.pending_launch = url, None
                table = ray.util.placement_group_table(handle.placement_group)
                handle.node_id = table["bundles_to_node_id"][0]
                mark(f"{handle.name} healthy (seen by the driver)")
        for handle in self.handles:
            if not handle.is_remote:
                handle.wait_healthy()
                mark(f"{handle.name} healthy (seen by the driver)")
        return [h.url for h in self.handles]

    async def statuses(self) -> list[tuple[bool, int | None]]:
        return list(await asyncio.gather(*(h.status() for h in self.handles)))

    def stop(self) -> None:
        for handle in reversed(self.handles):
            handle.stop()
