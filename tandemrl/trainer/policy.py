"""The policy module the actor trains: an HF causal LM wrapped so one forward returns the logprobs
(and entropies) of the next tokens at the loss positions only, plus its placement (device, dtype,
process group, FSDP2 sharding).

Why a wrapper: logits over a 50k-150k vocabulary for every packed token would dominate memory, yet
only model-sampled tokens need them. The wrapper runs the HF decoder, selects the hidden states of the
loss positions and computes logprobs in chunks, each chunk recomputed in backward instead of kept.
The wrapper is the FSDP root, so the root's parameters (embeddings, final norm, lm_head, tied or not)
are gathered around this forward; each decoder layer is its own FSDP unit.
Invariant: `PolicyModel.hf` is a plain HF model, so its parameter names are the HF names.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

LOGIT_CHUNK_TOKENS = 1024


def _chunk_logprobs(hidden_KH, weight_VH, bias_V, labels_K, inv_temperature: float, entropy_pass: dict):
    logits_KV = F.linear(hidden_KH, weight_VH, bias_V).float()
    if inv_temperature != 1.0:
        logits_KV = logits_KV * inv_temperature
    lse_K = logits_KV.logsumexp(-1)
    logprobs_K = logits_KV.gather(-1, labels_K[:, None])[:, 0] - lse_K
    if not entropy_pass["todo"]:
        return logprobs_K, torch.zeros_like(lse_K)
    entropy_pass["todo"] = False  # the checkpoint's recompute in backward skips this metric-only work
    with torch.no_grad():
        entropy_K = lse_K - (logits_KV.softmax(-1) * logits_KV).sum(-1)
    return logprobs_K, entropy_K


def chunked_logprobs(
    hidden_KH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    labels_K: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[label] per row, in chunks; in training each chunk's logits are recomputed
    in backward rather than stored (peak memory: one chunk of logits)."""
    logprobs, entropies = [], []
    needs_grad = torch.is_grad_enabled() and (hidden_KH.requires_grad or weight_VH.requires_grad)
    for start in range(0, hidden_KH.shape[0], chunk_tokens):
        args = (
            hidden_KH[start : start + chunk_tokens],
            weight_VH,
            bias_V,
            labels_K[start : start + chunk_tokens],
            1.0 / temperature,
            {"todo": with_entropy},
        )
        out = (
            checkpoint(_chunk_logprobs, *args, use_reentrant=False) if needs_grad else _chunk_logprobs(*args)
        )
        logprobs.append(out[0])
        entropies.append(out[1])
    return torch.cat(logprobs), torch.cat(entropies)


class PolicyModel(nn.Module):
    """HF causal LM -> next-token logprobs at selected positions of a packed row."""

    def __init__(self, hf_model: nn.Module, temperature: float = 1.0):
        super().__init__()
        self.hf = hf_model
        self.temperature = temperature

    def forward(
        self,
        input_ids_RL: torch.Tensor,
        position_ids_RL: torch.Tensor,
        attention_mask_RL: torch.Tensor | None,
        labels_N: torch.Tensor,
        select_K: torch.Tensor,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.hf.base_model(
            input_ids=input_ids_RL,
            position_ids=position_ids_RL,
            attention_mask=attention_mask_RL,
            use_cache=False,
        )
        hidden_NH = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        head = self.hf.get_output_embeddings()
        return chunked_logprobs(
            hidden_NH.index_select(0, select_K),
            head.weight,
            head.bias,
            labels_N.index_select(0, select_K),
            self.temperature,
            with_entropy,
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("actor.device=cuda but CUDA is not available. Set actor.device=cpu or auto.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_attn_implementation(name: str, device: torch.device) -> str:
    """auto: flash_attention_2 (varlen, so micro-batches are packed) when the flash_attn package is
    installed and the actor is on CUDA; sdpa otherwise (micro-batches are length-sorted padded rows)."""
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def uses_packed_rows(attn_implementation: str) -> bool:
    """Only varlen kernels make a packed row as cheap as separate sequences."""
    return attn_implementation.startswith("flash")


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 compute on GPU (fp32 master weights), fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the launcher's process group (env:// with RANK/WORLD_SIZE > 1) or create a 1-rank one, so
    one process runs the same FSDP code as many. Returns (rank, world_size)."""
    if not dist.is_initialized():
        # gloo for CPU tensors (metrics objects, CPU actors), NCCL for CUDA ones: one group serves both, so
        # a CPU actor and a CUDA actor can live in one process (tests) on the same default group
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size()


def is_sharded(policy: nn.Module) -> bool:
    return isinstance(policy, FSDPModule)


def reshard(policy: nn.Module) -> None:
    """Free the gathered parameters (after a no-grad forward the root keeps them), so that
    `parameters()` are the sharded masters again."""
    if is_sharded(policy):
        policy.reshard()


def shard_policy(policy: PolicyModel, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2: one unit per decoder layer, the wrapper as root; fp32 master weights, `compute_dtype`
    for forward/backward, fp32 gradient reduction.

    A single rank computing in fp32 (the CPU default) keeps the plain module: there FSDP would only
    copy every parameter in and out around each forward and backward (~40% of a CPU step, measured
    on SmolLM2-135M), with nothing to shard or cast. Everything else (loss scaling, clipping, DCP
    checkpoints, full weights) is the same code for both.
    """
    if dist.get_world_size() == 1 and compute_dtype == torch.float32:
        policy.to(device)
        return
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    layers = getattr(policy.hf.base_model, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(policy.hf).__name__}: no `.layers` on its base model; the actor shards "
            "decoder layers of Llama/Qwen/GLM-style HF models."
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
