"""The run's CPU plan (`cluster.cpu_pinning`): which cores each actor rank and each engine keep for
themselves on the node, and which the rest of the run (driver, agents, retrieval server, Ray's daemons)
shares. See docs/DESIGN.md, Sharing a GPU.

Why: the actor's train step and the engine's loop are each one host thread that launches GPU work, and
on one shared GPU neither waits on the GPU much; they wait on their core. On the H200 the concurrent
train step took 1.0 s of CPU and up to 3.9 s of wall time while it was preempted hundreds of times a
step (`perf/actor/involuntary_switches`, benchmarks/results/runner/colocated_h200_40steps); with its
own cores nothing else of the run can take them.

Invariants: reserved cores are taken from the top of the driver's own set (`host/cpus.py
available_cpus`, so a `taskset` or cpuset the user gave is respected), one disjoint block per actor rank
and per engine, and the rest keeps at least `MIN_SHARED` cores (auto: `MIN_SHARED_AUTO`). Only one node
is planned: on several nodes the processes of other nodes are not started from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandemrl.config.errors import ConfigError
from tandemrl.host.cpus import available_cpus, can_pin, id_ranges

if TYPE_CHECKING:
    from tandemrl.cluster.placement import PlacementPlan
    from tandemrl.config.schema import TandemConfig

MIN_SHARED = 1  # cores left to the rest of the run under cpu_pinning=always
MIN_SHARED_AUTO = 4  # under auto: the driver, the retrieval server and Ray keep room to work


@dataclass(frozen=True)
class CpuPlan:
    actor: tuple[tuple[int, ...], ...]  # per actor rank
    engines: tuple[tuple[int, ...], ...]  # per engine instance; () = the shared cores
    shared: tuple[int, ...]  # the driver and everything it starts unpinned

    def describe(self) -> list[str]:
        lines = [f"  actor rank {rank}: cores {id_ranges(cpus)}" for rank, cpus in enumerate(self.actor)]
        lines += [
            f"  rollout engine {index}: cores {id_ranges(cpus)}"
            if cpus
            else f"  rollout engine {index}: shared cores"
            for index, cpus in enumerate(self.engines)
        ]
        lines.append(f"  driver, retrieval server, Ray: cores {id_ranges(self.shared)}")
        return lines


def plan_cpus(
    config: TandemConfig, plan: PlacementPlan, available: list[int] | None = None
) -> tuple[CpuPlan | None, str]:
    """(the plan or None, why) for `cluster.cpu_pinning`; ConfigError when `always` cannot be honoured."""
    cluster = config.cluster
    mode = cluster.cpu_pinning
    if mode == "never":
        return None, "never (set)"
    auto = mode == "auto"
    why_not = _why_not(config, plan)
    if why_not:
        if auto:
            return None, f"off (auto: {why_not})"
        raise ConfigError(
            f"cluster.cpu_pinning=always, but {why_not}. Set cluster.cpu_pinning=auto or never."
        )
    if auto and not plan.shares_gpu:
        return None, "off (auto: the actor and the engines do not share a GPU)"
    cpus = available if available is not None else available_cpus()
    num_engines = len(plan.engines)
    reserved = len(plan.actor) * cluster.cpus_per_actor_rank + num_engines * cluster.cpus_per_engine
    least = MIN_SHARED_AUTO if auto else MIN_SHARED
    if len(cpus) - reserved < least:
        what = (
            f"{len(plan.actor)} actor rank(s) x cluster.cpus_per_actor_rank={cluster.cpus_per_actor_rank} + "
            f"{num_engines} engine(s) x cluster.cpus_per_engine={cluster.cpus_per_engine} = {reserved} cores "
            f"reserved of this machine's {len(cpus)} would leave {max(0, len(cpus) - reserved)} to the rest of "
            f"the run, which needs at least {least}"
        )
        if auto:
            return None, f"off (auto: {what})"
        raise ConfigError(
            f"cluster.cpu_pinning=always: {what}. Lower those keys, or set cluster.cpu_pinning=never."
        )
    free = list(cpus)

    def take(count: int) -> tuple[int, ...]:
        block = tuple(free[len(free) - count :]) if count else ()
        del free[len(free) - count :]
        return block

    actor = tuple(take(cluster.cpus_per_actor_rank) for _ in plan.actor)
    engines = tuple(take(cluster.cpus_per_engine) for _ in plan.engines)
    why = "always (set)" if not auto else "on (auto: the actor and an engine share a GPU)"
    return CpuPlan(actor, engines, tuple(free)), why


def _why_not(config: TandemConfig, plan: PlacementPlan) -> str | None:
    """What keeps a run from pinning its processes, or None."""
    cluster = config.cluster
    if not can_pin():
        return "this system has no CPU affinity (Linux sched_setaffinity)"
    if cluster.num_nodes > 1 or cluster.ray_address:
        return "the run spans a Ray cluster, and only this machine's processes are started from here"
    if not cluster.use_ray:
        return "cluster.use_ray=false trains the actor in the driver's own process"
    if not plan.engines:
        return "the engines are external (rollout.server_addrs)"
    return None
