"""What one actor rank holds in memory, from the model's parameter counts alone (`tandem train --dry-run`).

The counts come from the model's config.json: the HF model is built on the meta device (no memory, no
weights), so a 30B model is measured in seconds on a machine without GPUs. The arithmetic follows the
actor as trainer/actor.py and trainer/policy.py build it today: weights and their gradients in
`actor.param_dtype` and AdamW's two moments in `actor.optim.state_dtype`, sharded 1/N by FSDP2 over N ranks
(bytes a parameter: fp32/fp32 16, bf16 weights 12, bf16 weights and moments 8, `BYTES_PER_PARAM`); while a
decoder layer runs, its parameters gathered in the compute dtype; the root (embeddings, final norm, lm_head)
kept gathered from forward to backward (`reshard_after_forward=False`). One rank keeps the plain module and,
over fp32 weights, computes under autocast, whose compute-dtype copies of the weights live until the forward
ends.

Invariant: an estimate, not a measurement. Activations, FSDP's prefetch of the next layer, a layer's
unsharded gradients before their reduce-scatter, the CUDA context and allocator slack are not in it, nor
the bf16 optimizer's fp32 temporaries (a few of 2**24 elements: trainer/low_precision.py STEP_CHUNK_NUMEL).
The arithmetic is plain Python; only `measure_model` imports torch and transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# weights + gradients (actor.param_dtype) + AdamW's exp_avg and exp_avg_sq (actor.optim.state_dtype)
BYTES_PER_PARAM = {
    (param, state): 2 * DTYPE_BYTES[param] + 2 * DTYPE_BYTES[state]
    for param in DTYPE_BYTES
    for state in DTYPE_BYTES
}
LOAD_CHUNK_BYTES = 64 * 2**20  # trainer/loading.py CHUNK_BYTES (a unit test keeps the two equal)


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of an HF causal LM, as the actor shards it."""

    num_params: int  # tied embeddings counted once
    num_root_params: int  # not under the base model's `.layers`: embeddings, final norm, lm_head
    num_layer_params: int  # the largest decoder layer
    num_layers: int


@dataclass(frozen=True)
class ActorMemory:
    """Bytes one actor rank holds at its peak (see the module docstring for what is left out)."""

    num_ranks: int
    compute_bytes: int  # 2 (bf16) or 4 (fp32): the dtype forward and backward run in
    weights: int
    gradients: int
    optimizer: int
    gathered_layer: int = 0  # FSDP (num_ranks > 1): one decoder layer unsharded while it runs
    gathered_root: int = 0  # FSDP: the root, gathered from forward to the end of backward
    autocast_copies: int = 0  # one rank below fp32: autocast's cast of every weight, until forward ends
    reference: int = 0  # the reference model's weights (algorithm.kl_coef > 0), sharded like the actor's
    offload: bool = False  # actor.cpu_offload: the sharded state (weights, gradients, optimizer) on the host

    @property
    def host(self) -> int:
        """Bytes on the host: the sharded state when offloaded, else none counted here."""
        return self.weights + self.gradients + self.optimizer + self.reference if self.offload else 0

    @property
    def total(self) -> int:
        """Bytes on the rank's device."""
        transient = self.gathered_layer + self.gathered_root + self.autocast_copies
        return transient + (
            0 if self.offload else self.weights + self.gradients + self.optimizer + self.reference
        )


def actor_memory_per_rank(
    size: ModelSize,
    num_ranks: int,
    compute_bytes: int,
    has_reference: bool = False,
    offload: bool = False,
    param_bytes: int = 4,
    state_bytes: int = 4,
) -> ActorMemory:
    """The estimate of one rank of an actor of `num_ranks` ranks computing in `compute_bytes` a value, its
    weights and gradients in `param_bytes` (actor.param_dtype), each AdamW moment in `state_bytes`
    (actor.optim.state_dtype); `offload` (actor.cpu_offload): FSDP on one rank too, its sharded state on the
    host."""
    if num_ranks < 1 or {compute_bytes, param_bytes, state_bytes} - {2, 4} or compute_bytes > param_bytes:
        raise ValueError(
            f"num_ranks={num_ranks} (>= 1), compute_bytes={compute_bytes}, param_bytes={param_bytes}, "
            f"state_bytes={state_bytes} (2 or 4; bf16 weights compute in bf16)"
        )

    def sharded(bytes_per_param: int) -> int:  # FSDP2 splits every parameter along dim 0 over the ranks
        return math.ceil(size.num_params * bytes_per_param / num_ranks)

    if num_ranks == 1 and not offload:
        is_autocast = compute_bytes < param_bytes
        transient = {"autocast_copies": size.num_params * compute_bytes if is_autocast else 0}
    else:
        transient = {
            "gathered_layer": size.num_layer_params * compute_bytes,
            "gathered_root": size.num_root_params * compute_bytes,
        }
    return ActorMemory(
        num_ranks,
        compute_bytes,
        weights=sharded(param_bytes),
        gradients=sharded(param_bytes),
        optimizer=sharded(2 * state_bytes),
        reference=sharded(param_bytes) if has_reference else 0,
        offload=offload,
        **transient,
    )


def load_peak_host_bytes(
    size: ModelSize,
    num_ranks_on_node: int,
    num_ranks: int,
    has_reference: bool = False,
    shards_on_host: bool = False,
    param_bytes: int = 4,
) -> int:
    """Host memory the actor's load takes on one node at its peak (trainer/loading.py). One rank: the whole
    model in `param_bytes` (actor.param_dtype), and a deep copy of it for a reference model. Several ranks:
    one fp32 chunk of rows in flight per rank (`LOAD_CHUNK_BYTES`), and the shards themselves where the actor
    runs on the CPU. A checkpoint whose tensor names need converting adds one copy on rank 0's node (the
    loader's fallback), which this leaves out."""
    if num_ranks == 1:
        return (2 if has_reference else 1) * param_bytes * size.num_params
    peak = num_ranks_on_node * LOAD_CHUNK_BYTES
    if shards_on_host:
        models = 2 if has_reference else 1
        peak += num_ranks_on_node * models * math.ceil(param_bytes * size.num_params / num_ranks)
    return peak


def measure_model(model_dir: str | Path) -> ModelSize:
    """Count the parameters of the HF causal LM whose config.json is in `model_dir`, built on the meta
    device (no weights read, nothing downloaded, no remote code run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `.layers` on its base model; the actor shards the decoder "
            "layers of Llama/Qwen/GLM-style HF models"
        )
    in_layers = {id(p) for p in layers.parameters()}
    params = list(model.parameters())  # shared (tied) parameters once
    return ModelSize(
        num_params=sum(p.numel() for p in params),
        num_root_params=sum(p.numel() for p in params if id(p) not in in_layers),
        num_layer_params=max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
        num_layers=len(layers),
    )
