"""The dry run's actor-memory lines: the per-rank estimate of trainer/memory_estimate.py for the planned
ranks, the load's host peak per node, and a warning where a GPU or a node's host memory cannot hold them.

Node 0 is this machine (`tandem train` runs its driver there), so its host memory and GPUs are read here;
another node's memory is not known from here and is said to be unknown, never guessed. The estimate
needs the model's config.json on this machine: nothing is downloaded (a hub id is looked up in the local
Hugging Face cache only). Whatever stops the estimate is one line of the dry run, never its failure.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.host.devices import resolve_dtype

if TYPE_CHECKING:
    from tandemrl.cluster.placement import PlacementPlan
    from tandemrl.config.schema import TandemConfig
    from tandemrl.trainer.memory_estimate import ActorMemory, ModelSize

log = logging.getLogger(__name__)

GIB, MIB = 2**30, 2**20


@dataclass(frozen=True)
class MachineMemory:
    """What this machine (node 0) has: its host memory and the memory of its smallest GPU (None: unknown)."""

    host_bytes: int | None
    gpu_bytes: int | None = None
    gpu_name: str = "no CUDA on this machine"  # which GPU `gpu_bytes` is, or why it is unknown


def probe_machine(with_gpu: bool) -> MachineMemory:
    """This machine's physical memory, and (`with_gpu`) its smallest visible GPU's; torch only for the GPU."""
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that says
        host_bytes = None
    if not with_gpu:
        return MachineMemory(host_bytes, None, "GPU not probed")
    import torch

    if not torch.cuda.is_available():
        return MachineMemory(host_bytes)
    totals = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    smallest = min(range(len(totals)), key=totals.__getitem__)
    return MachineMemory(host_bytes, totals[smallest], f"GPU {smallest}")


def find_model_dir(model_path: str | None) -> tuple[Path | None, str]:
    """(the directory of the actor's config.json, "") or (None, why there is none here)."""
    from tandemrl.host.home import default_model_dir

    path = Path(model_path) if model_path else default_model_dir()
    if (path / "config.json").is_file():
        return path, ""
    if model_path and not path.is_absolute() and len(path.parts) == 2 and not model_path.startswith("."):
        from huggingface_hub import try_to_load_from_cache

        try:  # a hub id: looked up in the local cache, never downloaded
            cached = try_to_load_from_cache(model_path, "config.json")
        except ValueError as error:  # not a valid repo id either
            return None, f"{model_path!r} is no local directory nor a Hugging Face repo id ({error})"
        if isinstance(cached, str):
            return Path(cached).parent, ""
        return None, f"{model_path!r} is no local directory and its config.json is not in the local HF cache"
    hint = "" if model_path else " (run `tandem prepare model`)"
    return None, f"{path} has no config.json{hint}"


def describe_actor_memory(
    config: TandemConfig, plan: PlacementPlan, machine: MachineMemory | None = None
) -> list[str]:
    """The dry run's lines on the actor's memory; each warning among them is also logged. `machine`:
    this machine's memory (None: probed)."""
    from tandemrl.trainer.memory_estimate import DTYPE_BYTES, actor_memory_per_rank, measure_model

    model_dir, why = find_model_dir(config.actor.model.model_path)
    if model_dir is None:
        return [f"actor memory: estimate unavailable, it needs the model's config.json: {why}"]
    try:
        size = measure_model(model_dir)
    except Exception as error:  # any model this build cannot make: the dry run says so and goes on
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return [f"actor memory: estimate unavailable for {model_dir}: {type(error).__name__}: {reason}"]
    on_gpu = any(p.gpus for p in plan.actor)
    param_dtype, state_dtype = config.actor.param_dtype, config.actor.optim.state_dtype
    # bf16 weights compute in bf16 (trainer/policy.py resolve_compute_dtype)
    compute = (
        "bfloat16"
        if param_dtype == "bfloat16"
        else resolve_dtype(config.actor.dtype, "cuda" if on_gpu else "cpu")
    )
    has_reference = config.algorithm.kl_coef > 0
    offload = config.actor.cpu_offload
    memory = actor_memory_per_rank(
        size,
        len(plan.actor),
        DTYPE_BYTES[compute],
        has_reference,
        offload,
        param_bytes=DTYPE_BYTES[param_dtype],
        state_bytes=DTYPE_BYTES[state_dtype],
    )
    if machine is None:
        machine = probe_machine(with_gpu=on_gpu and any(p.node == 0 for p in plan.actor))
    ranks_per_node = Counter(p.node for p in plan.actor)
    capacity, warnings = _capacity(config, plan, memory, machine, ranks_per_node)
    lines = [
        f"actor model: {_count(size.num_params)} parameters (root {_count(size.num_root_params)}, largest "
        f"of {size.num_layers} decoder layers {_count(size.num_layer_params)}), from {model_dir}",
        f"actor memory per rank (estimate, {memory.num_ranks} rank{'s' if memory.num_ranks > 1 else ''}, "
        f"{_short(compute)} compute, {_precision(param_dtype, state_dtype)}): {_parts(memory)}{capacity}",
        "  (not counted: activations, FSDP's prefetch of the next layer, unsharded gradients before their "
        "reduce-scatter, the CUDA context, allocator slack)",
    ]
    load_lines, load_warnings = _load_lines(
        size, ranks_per_node, has_reference, machine, shards_on_host=not on_gpu, param_dtype=param_dtype
    )
    lines += load_lines
    warnings += load_warnings
    for warning in warnings:
        log.warning(warning)
    return lines + [f"warning: {warning}" for warning in warnings]


def _load_lines(
    size: ModelSize,
    ranks_per_node: Counter,
    has_reference: bool,
    machine: MachineMemory,
    shards_on_host: bool,
    param_dtype: str = "float32",
) -> tuple[list[str], list[str]]:
    """(a line per node of actor ranks on the load's host peak there; the warnings)."""
    from tandemrl.trainer.memory_estimate import DTYPE_BYTES, load_peak_host_bytes

    num_ranks = sum(ranks_per_node.values())
    if num_ranks == 1:
        how = f"one rank loads the full model in {_short(param_dtype)}" + (
            " and copies it for the reference model" if has_reference else ""
        )
    else:
        how = "rank 0 streams the checkpoint into every rank's shards" + (
            ", held on the host" if shards_on_host else ""
        )
    lines, warnings = [], []
    for node, num_ranks_on_node in sorted(ranks_per_node.items()):
        peak = load_peak_host_bytes(
            size,
            num_ranks_on_node,
            num_ranks,
            has_reference,
            shards_on_host=shards_on_host,
            param_bytes=DTYPE_BYTES[param_dtype],
        )
        line = f"load: up to {_gib(peak)} of host memory on node {node} ({how})"
        if node != 0 or machine.host_bytes is None:
            lines.append(f"{line}; node {node}'s host memory is unknown from here")
            continue
        lines.append(f"{line}, of {_gib(machine.host_bytes)} on this machine")
        if peak > machine.host_bytes:
            warnings.append(
                f"the actor's load needs up to {_gib(peak)} of host memory on node 0 ({num_ranks_on_node} rank(s); "
                f"{how}), more than this machine's {_gib(machine.host_bytes)}: the ranks would run out of memory "
                "while loading. Spread the actor's ranks over more nodes (cluster.component_placement) or use a "
                "node with more memory."
            )
    return lines, warnings


def _capacity(
    config: TandemConfig,
    plan: PlacementPlan,
    memory: ActorMemory,
    machine: MachineMemory,
    ranks_per_node: Counter,
) -> tuple[str, list[str]]:
    """(what the per-rank total is compared with, as the end of its line; the warnings)."""
    total = memory.total
    if not any(p.gpus for p in plan.actor):
        held = total * ranks_per_node.get(0, 0)
        if machine.host_bytes is None or not held:
            return "; CPU ranks, in host memory", []
        line = f"; CPU ranks: {_gib(held)} on node 0, of {_gib(machine.host_bytes)} of host memory"
        if held <= machine.host_bytes:
            return line, []
        return line, [
            f"the actor's {ranks_per_node[0]} CPU rank(s) on node 0 need an estimated {_gib(held)}, more than "
            f"this machine's {_gib(machine.host_bytes)} of host memory. Raise actor.num_ranks over more nodes, "
            "or use a smaller model."
        ]
    elsewhere = sorted(node for node in ranks_per_node if node != 0)
    unknown = f"; node(s) {', '.join(map(str, elsewhere))}: GPU memory unknown from here" if elsewhere else ""
    if 0 not in ranks_per_node:
        return unknown, []
    host_line, warnings = _offloaded_host(memory, machine, ranks_per_node[0])
    unknown += host_line
    if machine.gpu_bytes is None:
        return f"; GPU memory unknown ({machine.gpu_name}){unknown}", warnings
    room, whose = machine.gpu_bytes, machine.gpu_name
    if plan.shares_gpu:
        share, counted = _engine_share(config, machine.gpu_bytes)
        room -= share
        whose = f"{whose}, shared with the rollout engine: {counted}"
    line = f" of {_gib(room)} ({whose}){unknown}"
    if total <= room:
        return line, warnings
    return line, [
        f"the actor's estimated {_gib(total)} per rank exceeds the {_gib(room)} of {whose}: it would run out "
        f"of GPU memory at its first step. Raise actor.num_ranks (weights, gradients and AdamW state are "
        "sharded over the ranks), or use GPUs with more memory.",
        *warnings,
    ]


def _offloaded_host(memory: ActorMemory, machine: MachineMemory, num_ranks: int) -> tuple[str, list[str]]:
    """actor.cpu_offload on GPU ranks: (the part of the line on node 0's host share of the state, held in
    pinned memory for the whole run; the warning when the machine cannot hold it)."""
    if not memory.offload:
        return "", []
    held = memory.host * num_ranks
    if machine.host_bytes is None:
        return f"; offloaded state {_gib(held)} on node 0's host (its memory unknown)", []
    line = f"; offloaded state {_gib(held)} on node 0's host, of {_gib(machine.host_bytes)}"
    if held <= machine.host_bytes:
        return line, []
    return line, [
        f"actor.cpu_offload keeps an estimated {_gib(held)} of weights, gradients and AdamW state in node 0's "
        f"pinned host memory ({num_ranks} rank(s)), more than this machine's {_gib(machine.host_bytes)}. "
        "Use bf16 weights or moments (actor.param_dtype, actor.optim.state_dtype), spread the ranks over more "
        "nodes, or keep the state on the GPU (actor.cpu_offload=false)."
    ]


def _engine_share(config: TandemConfig, gpu_bytes: int) -> tuple[int, str]:
    """(bytes of a shared GPU the engine takes, as the config says it; what was counted)."""
    rollout = config.rollout
    if rollout.backend == "sglang":
        fraction = rollout.sglang.mem_fraction_static
        return int(fraction * gpu_bytes), f"rollout.sglang.mem_fraction_static={fraction} left out"
    if rollout.backend == "vllm":
        fraction = rollout.vllm.gpu_memory_utilization
        return int(fraction * gpu_bytes), f"rollout.vllm.gpu_memory_utilization={fraction} left out"
    kv_gb = rollout.engine.kv_cache_gb
    if kv_gb is not None:
        return int(kv_gb * GIB), f"its KV cache rollout.engine.kv_cache_gb={kv_gb} left out, its weights not"
    return 0, "its share not counted (set rollout.engine.kv_cache_gb to count its KV cache)"


def _parts(memory: ActorMemory) -> str:
    """The per-rank parts and their total, all in the total's unit."""
    parts = [("weights", memory.weights), ("gradients", memory.gradients), ("optimizer", memory.optimizer)]
    parts += [
        (name, value)
        for name, value in (
            ("gathered layer", memory.gathered_layer),
            ("gathered root", memory.gathered_root),
            ("autocast copies", memory.autocast_copies),
            ("reference weights", memory.reference),
        )
        if value
    ]
    unit = GIB if max(memory.total, memory.host) >= GIB else MIB
    listed = ", ".join(f"{name} {_gib(value, unit)}" for name, value in parts)
    if memory.offload:  # actor.cpu_offload: the sharded state is on the host
        return f"{listed}; on the host (actor.cpu_offload) {_gib(memory.host, unit)}, total on the GPU {_gib(memory.total, unit)}"
    return f"{listed}; total {_gib(memory.total, unit)}"


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def _precision(param_dtype: str, state_dtype: str) -> str:
    """What the weights and AdamW's moments are stored in (actor.param_dtype, actor.optim.state_dtype)."""
    weights = "fp32 masters" if param_dtype == "float32" else "bf16 weights"
    if param_dtype == state_dtype == "float32":
        return weights
    return f"{weights}, {_short(state_dtype)} AdamW moments"


def _gib(num_bytes: int, unit: int | None = None) -> str:
    """In GiB, or MiB below 1 GiB (or in `unit`): two decimals, one from 100 up."""
    unit = unit or (GIB if num_bytes >= GIB else MIB)
    value = num_bytes / unit
    return f"{value:.{1 if value >= 100 else 2}f} {'GiB' if unit == GIB else 'MiB'}"


def _count(num_params: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if num_params >= scale:
            return f"{num_params / scale:.2f} {unit}"
    return str(num_params)
