"""The placement plan: which process runs on which node and GPUs, and the weight-sync route between them.

`cluster.component_placement` names global GPU ids the RLinf way (`actor: 0-7`, `rollout: 8-15`,
`actor,rollout: 0`); global id g is GPU g % num_gpus_per_node of node g // num_gpus_per_node. The plan
is pure Python (no Ray, no torch), so `tandem train --dry-run` prints it on a machine without GPUs;
`cluster/ray_nodes.py` checks it against what Ray reports before anything is placed.

Invariants: every actor rank holds one GPU (or none on CPU); every rollout engine instance holds
`rollout.tensor_parallel_size` consecutive GPUs of one node; a GPU is shared by the actor and the
rollout only where the placement says so. See docs/DESIGN.md (processes and where they run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandemrl.config.derive import parse_gpu_range
from tandemrl.config.schema import ConfigError
from tandemrl.host.cpus import id_ranges

if TYPE_CHECKING:
    from tandemrl.config.schema import TandemConfig


@dataclass
class ProcessPlacement:
    """One process of the run: `gpus` are GPU ids local to `node` (empty: a CPU process)."""

    name: str
    node: int
    gpus: list[int] = field(default_factory=list)

    def describe(self, ray_chooses: bool = False) -> str:
        """`ray_chooses`: Ray places the process on its node and picks which of the node's GPUs it gets
        (a bundle asks for a count; Ray sets CUDA_VISIBLE_DEVICES), so only the count is a promise."""
        if not self.gpus:
            return f"{self.name}: node {self.node}, CPU"
        if ray_chooses:
            return f"{self.name}: node {self.node}, {_count(self.gpus)} (Ray chooses which)"
        return (
            f"{self.name}: node {self.node}, GPU{'s' if len(self.gpus) > 1 else ''} {format_gpus(self.gpus)}"
        )


def _count(gpus: list[int]) -> str:
    return f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"


@dataclass
class PlacementPlan:
    num_nodes: int
    num_gpus_per_node: int
    actor: list[ProcessPlacement]
    engines: list[ProcessPlacement]  # empty: external engines (rollout.server_addrs)
    retrieval: ProcessPlacement | None  # None: an external retrieval server (retrieval.launch=false)
    weight_sync: str
    shares_gpu: bool  # the actor and an engine share a GPU
    colocated_policy: str = "concurrent"  # time_share | concurrent, resolved from cluster.colocated_policy

    @property
    def uses_gpus(self) -> bool:
        return any(p.gpus for p in self.actor + self.engines)


def format_gpus(gpus: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2] -> '0,2'."""
    return id_ranges(gpus)


def _global_gpus(config: TandemConfig, component: str) -> list[int] | None:
    placement = config.cluster.component_placement
    for key, spec in placement.items():
        if component in key.split(","):
            return parse_gpu_range(spec, f"cluster.component_placement.{key}")
    return None


def _locate(config: TandemConfig, gpus: list[int], key: str) -> list[tuple[int, int]]:
    """Global GPU ids -> (node, local GPU id), checked against num_nodes x num_gpus_per_node."""
    cluster = config.cluster
    per_node = cluster.num_gpus_per_node
    if per_node == 0:
        if cluster.num_nodes > 1:
            raise ConfigError(
                f"cluster.num_gpus_per_node=0 with cluster.num_nodes={cluster.num_nodes}: global GPU ids in "
                f"{key} cannot be mapped to nodes. Set cluster.num_gpus_per_node (e.g. 8)."
            )
        per_node = max(gpus) + 1
    total = cluster.num_nodes * per_node
    for gpu in gpus:
        if not 0 <= gpu < total:
            raise ConfigError(
                f"{key} names GPU {gpu}, but the cluster has {total} GPUs (cluster.num_nodes="
                f"{cluster.num_nodes} x cluster.num_gpus_per_node={per_node}, ids 0-{total - 1}). Use ids "
                "below that, or raise cluster.num_nodes / cluster.num_gpus_per_node."
            )
    return [(gpu // per_node, gpu % per_node) for gpu in gpus]


def _actor_ranks(config: TandemConfig) -> list[ProcessPlacement]:
    num_ranks = config.actor.num_ranks
    gpus = _global_gpus(config, "actor")
    if gpus is None:
        on_gpu = config.actor.device == "cuda"
        return [ProcessPlacement(f"actor rank {r}", 0, [r] if on_gpu else []) for r in range(num_ranks)]
    if len(gpus) != num_ranks:
        raise ConfigError(
            f"cluster.component_placement names {len(gpus)} actor GPUs ({format_gpus(gpus)}) but "
            f"actor.num_ranks={num_ranks}: the actor runs one rank per GPU. Make them agree."
        )
    located = _locate(config, gpus, "cluster.component_placement (actor)")
    return [ProcessPlacement(f"actor rank {r}", node, [gpu]) for r, (node, gpu) in enumerate(located)]


def _engines(config: TandemConfig) -> list[ProcessPlacement]:
    rollout = config.rollout
    if rollout.server_addrs:
        return []
    kind = "SGLang server" if rollout.backend == "sglang" else f"{rollout.backend} engine"
    gpus = _global_gpus(config, "rollout")
    if gpus is None:
        on_gpu = rollout.device == "cuda"
        tp = rollout.tensor_parallel_size
        return [
            ProcessPlacement(f"rollout {kind} {i}", 0, list(range(tp)) if on_gpu else [])
            for i in range(rollout.instances)
        ]
    located = _locate(config, gpus, "cluster.component_placement (rollout)")
    tp, engines = rollout.tensor_parallel_size, []
    for index in range(len(located) // tp):
        chunk = located[index * tp : (index + 1) * tp]
        nodes = {node for node, _ in chunk}
        if len(nodes) > 1:
            raise ConfigError(
                f"rollout engine {index} would span nodes {sorted(nodes)} (GPUs {format_gpus(gpus)} in "
                f"groups of rollout.tensor_parallel_size={tp}): a tensor-parallel engine runs on one node. "
                "Align the rollout GPUs to node boundaries."
            )
        engines.append(ProcessPlacement(f"rollout {kind} {index}", chunk[0][0], [g for _, g in chunk]))
    return engines


def weight_sync_route(
    config: TandemConfig, actor: list[ProcessPlacement], engines: list[ProcessPlacement]
) -> str:
    """rollout.weight_sync=auto: gloo when either side is on CPU; CUDA IPC when actor rank 0 and every
    engine share one GPU; otherwise NCCL from actor rank 0 (every backend; disk only when asked for)."""
    if config.rollout.weight_sync != "auto":
        return config.rollout.weight_sync
    rank0 = actor[0]
    on_cpu = "cpu" in (config.actor.device, config.rollout.device)  # GPU ids may stand for CPU slots
    if on_cpu or not rank0.gpus or (engines and not all(e.gpus for e in engines)):
        return "gloo"
    if engines and all(e.node == rank0.node and e.gpus == rank0.gpus for e in engines):
        return "cuda_ipc"
    return "nccl"


def resolve_colocated_policy(config: TandemConfig, shares_gpu: bool) -> tuple[str, str]:
    """(policy, why) for `cluster.colocated_policy`: auto is time_share exactly when the async runner has
    the actor and an engine on one GPU without MPS and nothing asks for overlap (drain, SM caps); under
    MPS their kernels run side by side, and overlapping them measured faster than taking turns (H200,
    docs/DESIGN.md, Sharing a GPU); the sync runner and separate GPUs run both sides as they always did."""
    cluster = config.cluster
    if cluster.colocated_policy != "auto":
        return cluster.colocated_policy, "set"
    if not config.runner.async_mode:
        return "concurrent", "auto: the sync runner never overlaps training with generation"
    if not shares_gpu:
        return "concurrent", "auto: the actor and the engines do not share a GPU"
    if config.rollout.pause_mode == "drain":
        return "concurrent", "auto: rollout.pause_mode=drain keeps nothing across a stand-down"
    if cluster.mps_sm_percent:
        return "concurrent", "auto: cluster.mps_sm_percent splits the SMs for sides running at once"
    if cluster.mps:
        return (
            "concurrent",
            "auto: under cluster.mps (MPS) the actor's and the engines' kernels run side by side",
        )
    return (
        "time_share",
        "auto: the actor and an engine share a GPU without MPS; the engines stand down while it trains",
    )


def plan_placement(config: TandemConfig) -> PlacementPlan:
    """The plan of a derived config; raises `ConfigError` when the placement does not fit."""
    cluster = config.cluster
    actor, engines = _actor_ranks(config), _engines(config)
    retrieval = (
        ProcessPlacement("retrieval server", cluster.retrieval_node) if config.retrieval.launch else None
    )
    actor_gpus = {(p.node, g) for p in actor for g in p.gpus}
    shares_gpu = any((e.node, g) in actor_gpus for e in engines for g in e.gpus)
    if shares_gpu and cluster.component_placement and "actor,rollout" not in cluster.component_placement:
        raise ConfigError(
            "cluster.component_placement gives the actor and the rollout overlapping GPUs under separate "
            "keys. Share GPUs on purpose with one key, e.g. `actor,rollout: 0`, or give them disjoint GPUs."
        )
    if not cluster.use_ray:
        _check_local_gpus(actor, engines)
    per_node = cluster.num_gpus_per_node or max([g + 1 for p in actor + engines for g in p.gpus], default=0)
    return PlacementPlan(
        cluster.num_nodes,
        per_node,
        actor,
        engines,
        retrieval,
        weight_sync_route(config, actor, engines),
        shares_gpu,
        resolve_colocated_policy(config, shares_gpu)[0],
    )


def _check_local_gpus(actor: list[ProcessPlacement], engines: list[ProcessPlacement]) -> None:
    """Without Ray the actor trains in the driver and the engines are its child processes, and nothing
    assigns them GPUs: each uses the first visible GPUs (the actor GPU 0, an engine of tensor-parallel
    size n GPUs 0 to n-1). A plan that names other GPUs (disjoint GPUs for the actor and the engines, a
    second engine) would be a plan the machine does not follow."""
    misplaced = [p for p in actor + engines if p.gpus and p.gpus != list(range(len(p.gpus)))]
    if misplaced:
        named = "; ".join(
            f"{p.name} on GPU{'s' if len(p.gpus) > 1 else ''} {format_gpus(p.gpus)}" for p in misplaced
        )
        raise ConfigError(
            f"cluster.use_ray=false, and the plan puts {named}: without Ray nothing assigns GPUs, so every "
            "process would run on the first visible GPU(s), all on GPU 0. Set cluster.use_ray=true to place "
            "them on their GPUs, or share GPU 0: cluster.component_placement={'actor,rollout': 0}."
        )


def describe_plan(config: TandemConfig, plan: PlacementPlan) -> list[str]:
    """The dry run's lines: processes with node and GPUs, the derived limits, the weight-sync route."""
    rollout, buffer = config.rollout, config.rollout_buffer
    lines = [f"cluster: {plan.num_nodes} node(s) x {plan.num_gpus_per_node} GPU(s)", "processes:"]
    ray = config.cluster.use_ray
    if ray and plan.uses_gpus:
        lines.append(
            "  (Ray places each process on its node; which of the node's GPUs it gets, Ray chooses: the "
            "plan's GPU ids are counts per node, not pinned ids)"
        )
    lines.append(
        f"  actor: {len(plan.actor)} rank(s) in one torch.distributed group, {_summary(plan.actor, ray)}"
    )
    lines += [f"  {p.describe(ray)}" for p in plan.actor]
    if plan.engines:
        tp = rollout.tensor_parallel_size
        lines.append(
            f"  rollout: {len(plan.engines)} {rollout.backend} instance(s) of tensor_parallel_size {tp}, "
            f"{_summary(plan.engines, ray)}"
        )
        lines += [f"  {p.describe(ray)}" for p in plan.engines]
    else:
        lines.append(f"  rollout: external {rollout.backend} servers at {', '.join(rollout.server_addrs)}")
    if plan.retrieval is not None:
        lines.append(f"  {plan.retrieval.describe()}")
    else:
        lines.append(f"  retrieval server: external at {config.tools.search.server_addr}")
    lines += [
        "derived limits:",
        f"  rollout.instances = {rollout.instances}",
        f"  rollout_buffer.max_inflight_groups = {buffer.max_inflight_groups}",
        f"  rollout_buffer.max_buffered_groups = {buffer.max_buffered_groups}",
        f"  rollout_buffer.max_dropped_groups_per_step = {buffer.max_dropped_groups_per_step}",
    ]
    lines += [f"  {key} derived: {how}" for key, how in config.derived.items()]
    lines.append(f"weight sync: {describe_route(plan)}")
    lines.append(f"rollout.pause_mode = {rollout.pause_mode} (how the engines stand for each weight sync)")
    policy, why = resolve_colocated_policy(config, plan.shares_gpu)
    lines.append(f"cluster.colocated_policy = {policy} ({why})")
    return lines


def _summary(processes: list[ProcessPlacement], ray_chooses: bool = False) -> str:
    """'node 0 GPUs 0-7' per node the processes use (or 'CPU'); '8 GPUs on node 0' where Ray chooses."""
    by_node: dict[int, list[int]] = {}
    for process in processes:
        by_node.setdefault(process.node, []).extend(process.gpus)
    return "; ".join(
        (f"{_count(gpus)} on node {node}" if ray_chooses else f"node {node} GPUs {format_gpus(sorted(gpus))}")
        if gpus
        else f"node {node} CPU"
        for node, gpus in sorted(by_node.items())
    )


def describe_route(plan: PlacementPlan) -> str:
    rank0 = plan.actor[0]
    if plan.weight_sync == "disk":
        return f"safetensors on disk from actor rank 0 (node {rank0.node}), loaded by the engine(s)"
    if plan.weight_sync == "gloo":
        return f"gloo (CPU) from actor rank 0 (node {rank0.node}) to {len(plan.engines) or 'the'} engine(s)"
    if plan.weight_sync == "cuda_ipc":
        return f"CUDA IPC on node {rank0.node} (actor rank 0 and the engine share its GPU)"
    nodes = sorted({e.node for e in plan.engines})
    return (
        f"NCCL broadcast from actor rank 0 (node {rank0.node}) to "
        f"{len(plan.engines)} engine(s) on node(s) {', '.join(map(str, nodes)) or '(external)'}"
    )
