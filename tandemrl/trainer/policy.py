"""The policy module the actor trains: an HF causal LM wrapped so one forward returns the logprobs
(and entropies) of the next tokens at the loss positions only, plus its placement (device, dtype,
process group, FSDP2 sharding).

Why a wrapper: logits over a 50k-150k vocabulary for every packed token would dominate memory, yet
only model-sampled tokens need them. The wrapper runs the HF decoder, selects the hidden states of the
loss positions and computes logprobs in chunks, each chunk recomputed in backward instead of kept.
Across ranks the wrapper is the FSDP root, so the root's parameters (embeddings, final norm, lm_head,
tied or not) are gathered around this forward; each decoder layer is its own FSDP unit. One rank runs
the plain module (under autocast below fp32).
Invariant: `PolicyModel.hf` is a plain HF model, so its parameter names are the HF names.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from tandemrl.host.devices import resolve_device as resolve_device_name
from tandemrl.host.devices import resolve_dtype
from tandemrl.trainer.varlen import VARLEN_ATTN, register_varlen_attention, varlen_kernel_works

log = logging.getLogger(__name__)

LOGIT_CHUNK_TOKENS = 1024
CPU_MICRO_BATCH_TOKENS = 8192
# auto micro-batch budget on CUDA: this share of the free memory for activations, at an estimated
# 16 (2 hidden + intermediate) bytes per token per layer (bf16 under autocast; SmolLM2-135M saves ~30 kB
# per token per layer, the estimate ~43 kB), in steps of 4096 tokens within these bounds
AUTO_MEMORY_FRACTION = 0.4
AUTO_TOKENS_STEP, AUTO_MAX_TOKENS = 4096, 65536


def _chunk_logits(hidden_kH, weight_VH, bias_V, inv_temperature: float) -> torch.Tensor:
    logits_kV = F.linear(hidden_kH, weight_VH, bias_V).float()
    return logits_kV.mul_(inv_temperature) if inv_temperature != 1.0 else logits_kV


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[label] (and, metric only, the entropy) per row, chunk by chunk.

    Only the fp32 log-normaliser of each row is kept for backward, which recomputes each chunk's logits
    and writes d logp / d logits = (onehot - softmax) / T in place: peak memory is one chunk of fp32
    logits, and no full-vocab copy is kept or made twice (as autograd of the eager ops would).
    Matmuls run in `compute_dtype`; the weight gradient accumulates in fp32 over chunks and is
    returned in the weight's own dtype.
    """

    @staticmethod
    def forward(ctx, hidden_KH, weight_VH, bias_V, labels_K, inv_temperature, compute_dtype, chunk, entropy):
        h_KH, w_VH = hidden_KH.to(compute_dtype), weight_VH.to(compute_dtype)
        b_V = None if bias_V is None else bias_V.to(compute_dtype)
        num_rows = h_KH.shape[0]
        logprobs_K = torch.empty(num_rows, dtype=torch.float32, device=h_KH.device)
        lse_K, entropy_K = torch.empty_like(logprobs_K), torch.zeros_like(logprobs_K)
        with torch.autocast(h_KH.device.type, enabled=False):
            for s in range(0, num_rows, chunk):
                logits_kV = _chunk_logits(h_KH[s : s + chunk], w_VH, b_V, inv_temperature)
                lse_k = logits_kV.logsumexp(-1)
                lse_K[s : s + chunk] = lse_k
                logprobs_K[s : s + chunk] = logits_kV.gather(-1, labels_K[s : s + chunk, None])[:, 0] - lse_k
                if entropy:
                    logp_kV = logits_kV.sub_(lse_k[:, None])
                    entropy_K[s : s + chunk] = -logp_kV.exp().mul_(logp_kV).sum(-1)
        ctx.save_for_backward(h_KH, w_VH, b_V, labels_K, lse_K)
        ctx.meta = (inv_temperature, chunk, hidden_KH.dtype, weight_VH.dtype)
        ctx.mark_non_differentiable(entropy_K)
        return logprobs_K, entropy_K

    @staticmethod
    def backward(ctx, grad_K, _grad_entropy):
        h_KH, w_VH, b_V, labels_K, lse_K = ctx.saved_tensors
        inv_temperature, chunk, hidden_dtype, weight_dtype = ctx.meta
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h_KH) if need_h else None
        grad_w = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) if need_w else None
        grad_b = torch.zeros(w_VH.shape[0], dtype=torch.float32, device=w_VH.device) if need_b else None
        with torch.autocast(h_KH.device.type, enabled=False):
            for s in range(0, h_KH.shape[0], chunk):
                h_kH, g_k = h_KH[s : s + chunk], grad_K[s : s + chunk].float()
                dz_kV = _chunk_logits(h_kH, w_VH, b_V, inv_temperature)
                dz_kV.sub_(lse_K[s : s + chunk, None]).exp_().mul_(-g_k[:, None])  # -g softmax
                dz_kV.scatter_add_(1, labels_K[s : s + chunk, None], g_k[:, None])  # + g onehot
                if inv_temperature != 1.0:
                    dz_kV.mul_(inv_temperature)
                if grad_b is not None:
                    grad_b += dz_kV.sum(0)
                dz_kV = dz_kV.to(w_VH.dtype)
                if grad_h is not None:
                    torch.mm(dz_kV, w_VH, out=grad_h[s : s + chunk])
                if grad_w is not None:
                    grad_w += dz_kV.t().mm(h_kH)  # fp32 accumulation of per-chunk partial sums
        grad_h = None if grad_h is None else grad_h.to(hidden_dtype)
        grad_w = None if grad_w is None else grad_w.to(weight_dtype)
        grad_b = None if grad_b is None else grad_b.to(weight_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_logprobs(
    hidden_KH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    labels_K: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logprobs of `labels_K`, fp32 entropies or zeros) under softmax(h W^T / T), in chunks of
    `chunk_tokens` rows; matmuls in `compute_dtype` (default: the weight's dtype)."""
    return _LinearLogprobs.apply(
        hidden_KH,
        weight_VH,
        bias_V,
        labels_K,
        1.0 / temperature,
        compute_dtype or weight_VH.dtype,
        chunk_tokens,
        with_entropy,
    )


def head_logit_scale(config) -> float:
    """The factor HF's causal-LM forward puts on the head's output before the softmax, which the actor's
    own head path (`chunked_logprobs`, trainer/greedy_gaps.py) applies too: Cohere's `logit_scale`
    multiplies the logits, Granite's `logits_scaling` divides them. A final soft cap (Gemma 2's
    `final_logit_softcapping`) is refused: the chunked head has no tanh in its forward or backward, so
    its logprobs would not be the model's."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"{config.model_type}: final_logit_softcapping={cap} caps the logits with a tanh, which the "
            "actor's chunked logprob head (trainer/policy.py chunked_logprobs) does not apply, so its "
            "logprobs would not be the model's. Models without a final soft cap train."
        )
    scale = getattr(config, "logit_scale", None)
    scaling = getattr(config, "logits_scaling", None)
    return float(scale if scale is not None else 1.0) / float(scaling if scaling is not None else 1.0)


class PolicyModel(nn.Module):
    """HF causal LM -> next-token logprobs at selected positions of a packed row."""

    def __init__(self, hf_model: nn.Module, temperature: float = 1.0):
        super().__init__()
        self.hf = hf_model
        self.temperature = temperature
        # softmax(scale * h W^T / T): the logit scale of the model's own forward, folded into T
        self.logit_scale = head_logit_scale(hf_model.config)
        # set by `shard_policy` for a single rank computing below fp32: autocast over fp32 weights
        self.autocast_dtype: torch.dtype | None = None

    def forward(
        self,
        input_ids_RL: torch.Tensor,
        position_ids_RL: torch.Tensor,
        attention_mask_RL: torch.Tensor | None,
        labels_N: torch.Tensor,
        select_K: torch.Tensor,
        with_entropy: bool = False,
        cu_seqlens_S: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cu_seqlens_S`/`max_seqlen`: sample boundaries of a packed row (host-computed, so the varlen
        kernels need no device sync to find them); HF hands them to every attention layer."""
        autocast = torch.autocast(
            input_ids_RL.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )
        varlen = {}
        if cu_seqlens_S is not None:
            varlen = dict(
                cu_seq_lens_q=cu_seqlens_S,
                cu_seq_lens_k=cu_seqlens_S,
                max_length_q=max_seqlen,
                max_length_k=max_seqlen,
            )
        with autocast:
            return self._logprobs(
                input_ids_RL, position_ids_RL, attention_mask_RL, labels_N, select_K, with_entropy, varlen
            )

    def _logprobs(
        self, input_ids_RL, position_ids_RL, attention_mask_RL, labels_N, select_K, with_entropy, varlen
    ):
        out = self.hf.base_model(
            input_ids=input_ids_RL,
            position_ids=position_ids_RL,
            attention_mask=attention_mask_RL,
            use_cache=False,
            **varlen,
        )
        hidden_NH = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        head = self.hf.get_output_embeddings()
        return chunked_logprobs(
            hidden_NH.index_select(0, select_K),
            head.weight,
            head.bias,
            labels_N.index_select(0, select_K),
            self.temperature / self.logit_scale,
            with_entropy,
            compute_dtype=self.autocast_dtype,
        )


# HF RMSNorm classes computing weight * (x * rsqrt(mean(x^2) + eps)) with x in fp32 (Gemma's 1 + weight
# differs and is left alone)
FUSABLE_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _fused_rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(hidden_states.float(), module.weight.shape, None, module.variance_epsilon)
    return module.weight * normed.to(hidden_states.dtype)  # HF's own expression around the norm


def fuse_rms_norms(hf_model: nn.Module) -> int:
    """Route HF's eager RMSNorm (pow, mean, add, rsqrt, mul: five fp32 passes forward, more backward,
    over the fp32 residual stream of every layer) through `F.rms_norm`, one fused kernel on CUDA; the
    arithmetic is HF's. Returns how many norms now take that path."""
    count = 0
    for module in hf_model.modules():
        if type(module).__name__ in FUSABLE_RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
            count += 1
    return count


def compile_layers(hf_model: nn.Module) -> None:
    """`torch.compile` every decoder layer in place (parameter names stay the HF ones), with dynamic
    shapes: packed rows change length every micro-batch and must not recompile each time."""
    layers = getattr(hf_model.base_model, "layers", None)
    if layers is None:
        raise ValueError(
            f"actor.compile_layers=true: {type(hf_model).__name__} has no `.layers` on its base model; "
            "set actor.compile_layers=false."
        )
    for layer in layers:
        layer.compile(dynamic=True)


def resolve_device(name: str) -> torch.device:
    name = resolve_device_name(name)
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("actor.device=cuda but CUDA is not available. Set actor.device=cpu or auto.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_attn_implementation(name: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """The HF attention implementation for `actor.attn_implementation`. auto on CUDA below fp32:
    flash_attention_2 when the flash_attn package is installed, else torch's own varlen flash kernel
    (`trainer.varlen`) when it passes its probe, else sdpa; sdpa on CPU. The varlen kinds pack
    micro-batches into one row; sdpa/eager use length-sorted padded rows."""
    if name == "varlen":
        register_varlen_attention()
        return VARLEN_ATTN
    if name != "auto":
        return name
    if device.type != "cuda" or compute_dtype == torch.float32:
        return "sdpa"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if varlen_kernel_works(device, compute_dtype):
        register_varlen_attention()
        return VARLEN_ATTN
    return "sdpa"


def uses_packed_rows(attn_implementation: str) -> bool:
    """Only varlen kernels make a packed row as cheap as separate sequences."""
    return attn_implementation.startswith("flash") or attn_implementation == VARLEN_ATTN


def auto_micro_batch_tokens(model_config, free_bytes: int) -> int:
    """Tokens whose estimated activations fill AUTO_MEMORY_FRACTION of `free_bytes` (see the constants)."""
    text = model_config.get_text_config()
    hidden = text.hidden_size
    per_layer = 16 * (2 * hidden + (getattr(text, "intermediate_size", None) or 4 * hidden))
    tokens = int(AUTO_MEMORY_FRACTION * free_bytes / (per_layer * text.num_hidden_layers))
    return min(AUTO_MAX_TOKENS, max(AUTO_TOKENS_STEP, tokens // AUTO_TOKENS_STEP * AUTO_TOKENS_STEP))


def resolve_micro_batch_tokens(value: int | None, model_config, device: torch.device) -> int:
    """`actor.micro_batch_tokens`, or for None: on CUDA `auto_micro_batch_tokens` of the free memory (a
    small model gets large micro-batches: far fewer kernel launches and Python layer calls per token),
    the minimum over ranks so every rank plans the same micro-batches; CPU_MICRO_BATCH_TOKENS on CPU."""
    if value is not None:
        return value
    if device.type != "cuda":
        return CPU_MICRO_BATCH_TOKENS
    free_bytes, _ = torch.cuda.mem_get_info(device)
    tokens = auto_micro_batch_tokens(model_config, free_bytes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([tokens], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        tokens = int(agreed.item())
    log.info("actor.micro_batch_tokens auto: %d (%.1f GiB free)", tokens, free_bytes / 2**30)
    return tokens


def resolve_compute_dtype(name: str, device: torch.device, param_dtype: str = "float32") -> torch.dtype:
    """auto: bf16 compute on GPU (over fp32 master weights), fp32 on CPU; bf16 wherever the weights are
    (`actor.param_dtype=bfloat16`: nothing casts them up, and the config refuses actor.dtype=float32)."""
    name = "bfloat16" if param_dtype == "bfloat16" else resolve_dtype(name, device.type)
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


def shard_policy(
    policy: PolicyModel,
    device: torch.device,
    compute_dtype: torch.dtype,
    cpu_offload: bool = False,
    param_dtype: torch.dtype = torch.float32,
) -> None:
    """FSDP2 across ranks: one unit per decoder layer, the wrapper as root; `param_dtype` sharded weights
    (fp32 masters, or bf16 under `actor.param_dtype=bfloat16`: the policy's parameters already are),
    `compute_dtype` for forward/backward, fp32 gradient reduction (cast back to `param_dtype` in the shard).

    A single rank keeps the plain module: FSDP would have nothing to shard, yet it would copy (and
    cast) every parameter in before each layer's forward and backward, and every gradient out after
    it, per micro-batch (~40% of a CPU fp32 step on SmolLM2-135M; 0.79x of a plain HF loop on an H200
    at 1.5B, bf16). Below fp32 it computes under autocast over fp32 weights instead: the same
    numerics as FSDP's mixed precision (bf16 matmuls, fp32 params, fp32 gradient accumulation over
    micro-batches). bf16 weights need no autocast: the module computes in bf16 as FSDP's unsharded bf16
    parameters do. Loss scaling, clipping, DCP checkpoints and full weights are the same code for both.
    `cpu_offload` (`actor.cpu_offload`, a GPU only): FSDP2 with its CPUOffloadPolicy, on one rank too.
    """
    if cpu_offload and device.type != "cuda":
        raise ValueError(
            f"actor.cpu_offload=true with the actor on {device.type}: offload moves a GPU actor's weights, "
            "gradients and optimizer state to the host, where a CPU actor already keeps them. Set "
            "actor.cpu_offload=false, or actor.device=cuda."
        )
    if param_dtype != torch.float32 and compute_dtype != param_dtype:
        raise ValueError(
            f"actor.param_dtype={str(param_dtype).removeprefix('torch.')} with compute dtype "
            f"{str(compute_dtype).removeprefix('torch.')}: bf16 weights compute in bf16. Set actor.dtype=bfloat16 "
            "(or auto), or actor.param_dtype=float32."
        )
    if dist.get_world_size() == 1 and not cpu_offload:
        policy.to(device)
        is_autocast = compute_dtype != torch.float32 and param_dtype == torch.float32
        policy.autocast_dtype = compute_dtype if is_autocast else None
        return
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == param_dtype else compute_dtype, reduce_dtype=torch.float32
    )
    layers = getattr(policy.hf.base_model, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(policy.hf).__name__}: no `.layers` on its base model; the actor shards "
            "decoder layers of Llama/Qwen/GLM-style HF models."
        )
    offload = CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(policy, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
