"""Placement of the actor: a worker group of `actor.num_ranks` Ray actors (`ray.remote(ActorWorker)`,
one FSDP rank each, each pinned by the placement plan to its node and GPU), or a single worker in the
runner's own process (`cluster.use_ray=false`). The ranks form one torch.distributed group whose
rendezvous is rank 0's node, so a group spans nodes (docs/DESIGN.md, processes and where they run).

Invariants: only this module (and runner/) imports ray; `ActorWorker` stays a plain class. Every call
is awaitable, so the runner's event loop (and the agent loops on it) keeps running while the actor
trains. Collective methods (train, push, checkpoints) run on every rank at once and return rank 0's
answer; the weight sender lives on rank 0 only, where the full tensors are sent from.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

from tandemrl.cluster.actor_worker import ActorWorker
from tandemrl.cluster.mps import sm_percent_env
from tandemrl.config.derive import actor_setup
from tandemrl.config.schema import ConfigError
from tandemrl.host.cpus import id_ranges

if TYPE_CHECKING:
    from tandemrl.cluster.placement import PlacementPlan
    from tandemrl.cluster.ray_nodes import NodeMap
    from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

RANK0_ONLY = ("get_weight_version", "connect_weight_sync")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class ActorGroup:
    """The actor's worker(s) behind an awaitable `call(method, *args)`. Construction only submits the
    workers (they load while the servers boot); `wait_ready()` blocks until every rank is built."""

    def __init__(
        self,
        config: TandemConfig,
        plan: PlacementPlan,
        nodes: NodeMap | None = None,
        cpus: tuple[tuple[int, ...], ...] = (),
    ):
        """`cpus`: each rank's cores (cluster/cpus.py); (): the run's shared cores."""
        self.setup = actor_setup(config)  # what each rank's worker builds its Actor from
        self.cpus = cpus
        self.uses_ray = config.cluster.use_ray
        self.num_ranks = config.actor.num_ranks
        self._worker: ActorWorker | None = None
        self.rank_node_ids: list[str] = []
        if not self.uses_ray:
            if self.num_ranks > 1:
                raise ConfigError(
                    f"actor.num_ranks={self.num_ranks} with cluster.use_ray=false: several actor "
                    "ranks run as a Ray worker group. Set cluster.use_ray=true, or actor.num_ranks=1."
                )
            return
        import ray
        import ray.util.scheduling_strategies

        from tandemrl.cluster.ray_nodes import NodeMap, init_ray
        from tandemrl.host.startup import log_path

        init_ray(config)
        nodes = nodes or NodeMap(config, plan)
        gpu_share = 0.5 if plan.shares_gpu else 1.0  # an engine holds the other half of a shared GPU
        num_gpus = [len(p.gpus) * gpu_share for p in plan.actor]
        bundles, selectors = nodes.pinned_bundles([p.node for p in plan.actor], num_gpus)
        self._placement = ray.util.placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
        # rank 0's node hosts the rendezvous; ranks on other nodes reach it at that node's address
        master = nodes[plan.actor[0].node].address if config.cluster.num_nodes > 1 else "127.0.0.1"
        master_port = _free_port()
        self._handles = []
        for rank, placement in enumerate(plan.actor):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": "0",  # Ray shows each rank only its own GPU
                "WORLD_SIZE": str(self.num_ranks),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(master_port),
            }
            strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=rank
            )
            options = {"scheduling_strategy": strategy, **nodes.remote_options(num_gpus[rank])}
            env_vars = {**(env if self.num_ranks > 1 else {}), **sm_percent_env(config, "actor")}
            if env_vars:
                options["runtime_env"] = {"env_vars": env_vars}
            rank_cpus = cpus[rank] if cpus else ()
            self._handles.append(
                ray.remote(ActorWorker).options(**options).remote(self.setup, log_path(), rank_cpus)
            )
            log.info("actor rank %d: node %d (%s)", rank, placement.node, nodes[placement.node].address)

    def wait_ready(self) -> ActorGroup:
        if not self.uses_ray:
            self._worker = ActorWorker(self.setup)
            return self
        import ray

        ray.get([h.get_weight_version.remote() for h in self._handles])  # construction errors surface here
        if self.cpus:
            for rank, cpus in enumerate(ray.get([h.cpus.remote() for h in self._handles])):
                log.info("actor rank %d runs on cores %s", rank, id_ranges(cpus))
        table = ray.util.placement_group_table(self._placement)["bundles_to_node_id"]
        self.rank_node_ids = [table[rank] for rank in range(self.num_ranks)]  # where Ray put each rank
        return self

    def _targets(self, method: str) -> list[Any]:
        return self._handles[:1] if method in RANK0_ONLY else self._handles

    async def call(self, method: str, *args: Any) -> Any:
        if not self.uses_ray:
            return await asyncio.to_thread(getattr(self._worker, method), *args)
        results = await asyncio.gather(*(getattr(h, method).remote(*args) for h in self._targets(method)))
        return results[0]

    def call_sync(self, method: str, *args: Any) -> Any:
        if not self.uses_ray:
            return getattr(self._worker, method)(*args)
        import ray

        return ray.get([getattr(h, method).remote(*args) for h in self._targets(method)])[0]

    def shutdown(self) -> None:
        if not self.uses_ray and self._worker is None:
            return
        try:
            self.call_sync("close")
        except Exception as error:  # the run is over; a failed close must not hide the run's result
            log.warning("closing the actor worker failed: %r", error)
        if self.uses_ray:
            import ray

            for handle in self._handles:
                ray.kill(handle)
            ray.util.remove_placement_group(self._placement)
