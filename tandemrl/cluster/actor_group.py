"""Placement of the actor: a worker group of `actor.num_ranks` Ray actors (`ray.remote(ActorWorker)`,
one FSDP rank each), or a single worker in the runner's own process (`cluster.use_ray=false`).

Invariants: only this module (and runner/) imports ray; `ActorWorker` stays a plain class. Every call
is awaitable, so the runner's event loop (and the agent loops on it) keeps running while the actor
trains. Collective methods (train, push, checkpoints) run on every rank at once and return rank 0's
answer; the weight sender lives on rank 0 only, where the full tensors are sent from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from tandemrl.cluster.actor_worker import ActorWorker
from tandemrl.config.derive import parse_gpu_range
from tandemrl.config.schema import ConfigError

log = logging.getLogger(__name__)

RANK0_ONLY = ("get_weight_version", "connect_weight_sync")


def gpus_per_rank(config: Any) -> float:
    """GPUs each actor rank asks Ray for: one on CUDA (the placement names num_ranks GPUs), else none."""
    spec = config.cluster.component_placement.get("actor")
    if spec is not None:
        num_gpus = len(parse_gpu_range(spec, "cluster.component_placement.actor"))
        if num_gpus != config.actor.num_ranks:
            raise ConfigError(
                f"cluster.component_placement.actor={spec!r} names {num_gpus} GPUs but actor.num_ranks="
                f"{config.actor.num_ranks}: the actor runs one rank per GPU. Make them agree."
            )
        return 1.0
    return 1.0 if config.actor.device == "cuda" else 0.0


def _init_ray(config: Any) -> None:
    import ray

    if ray.is_initialized():
        return
    address = config.cluster.ray_address or ("auto" if config.cluster.num_nodes > 1 else None)
    if address:  # join the cluster started by `ray start` on every node
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:  # local Ray: this machine only, bound to loopback, its token private
        from tandemrl.cluster.ray_security import harden_local_ray, local_ray_kwargs

        harden_local_ray()  # a token left by an earlier run
        ray.init(
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=True,
            **local_ray_kwargs(),
        )
        harden_local_ray()  # the token this start may have written


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ActorGroup:
    """The actor's worker(s) behind an awaitable `call(method, *args)`."""

    def __init__(self, config: Any):
        self.uses_ray = config.cluster.use_ray
        self.num_ranks = config.actor.num_ranks
        if not self.uses_ray:
            if self.num_ranks > 1:
                raise ConfigError(
                    f"actor.num_ranks={self.num_ranks} with cluster.use_ray=false: several actor "
                    "ranks run as a Ray worker group. Set cluster.use_ray=true, or actor.num_ranks=1."
                )
            self._worker = ActorWorker(config)
            return
        import ray
        import ray.util.scheduling_strategies

        _init_ray(config)
        num_gpus = gpus_per_rank(config)
        remote_cls = ray.remote(num_cpus=1, num_gpus=num_gpus)(ActorWorker)
        # all ranks on one node (STRICT_PACK), so they rendezvous on 127.0.0.1
        bundles = [{"CPU": 1, **({"GPU": num_gpus} if num_gpus else {})} for _ in range(self.num_ranks)]
        self._placement = ray.util.placement_group(bundles, strategy="STRICT_PACK")
        ray.get(self._placement.ready())
        master_port = _free_port()
        self._handles = []
        for rank in range(self.num_ranks):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(self.num_ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
            }
            strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=rank
            )
            options = {"scheduling_strategy": strategy}
            if self.num_ranks > 1:
                options["runtime_env"] = {"env_vars": env}
            self._handles.append(remote_cls.options(**options).remote(config))
        ray.get([h.get_weight_version.remote() for h in self._handles])  # construction errors surface here
        log.info("actor: %d Ray worker(s), %s GPU(s) each", self.num_ranks, gpus_per_rank(config))

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
        try:
            self.call_sync("close")
        except Exception as error:  # the run is over; a failed close must not hide the run's result
            log.warning("closing the actor worker failed: %r", error)
        if self.uses_ray:
            import ray

            for handle in self._handles:
                ray.kill(handle)
            ray.util.remove_placement_group(self._placement)
