"""Variable-length attention for packed micro-batches without the flash_attn package.

sdpa has no varlen kernel, so without flash_attn the actor used length-sorted padded rows: every row
pays its padding in every layer, groups break where lengths drop by a quarter (many small
micro-batches), and HF builds a 4-D mask per forward. torch ships FlashAttention-2 itself behind
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA, bf16/fp16), so the actor can pack a
micro-batch into one row and attend within each sample, as with flash_attn.

`VARLEN_ATTN` is registered with HF's `AttentionInterface` under that name; HF builds no mask for it
(the name is not in its mask registry) and hands the kwargs of the model's forward to every layer, so
the policy passes the sample boundaries (`cu_seq_lens_q`, `max_length_q`, computed on the host) there.
On CPU (tests) and wherever the torch kernel is missing or fails the start-up probe, each sample
runs causal sdpa on its own slice: the same function, slower.
Invariant: the output equals causal attention of each sample alone (checked against sdpa in
tests/unit/test_varlen.py and, on CUDA, by `varlen_kernel_works` before the actor relies on it).
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

VARLEN_ATTN = "tandem_varlen"


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_KERNEL_OPTIONS: tuple[dict, bool] | None = None  # _kernel_options(), read once outside compiled code


def _kernel_options() -> tuple[dict, bool]:
    """(causal keyword, takes enable_gqa) of this torch's varlen_attn: its keywords changed across
    releases (2.10 took `is_causal`, later ones `window_size`, the latest also `enable_gqa`). Kept in a
    module global, not a `functools.cache`: Dynamo ignores that wrapper inside the compiled layers (and
    warns), while a global set before compiling (`register_varlen_attention`) it reads as a constant."""
    global _KERNEL_OPTIONS
    if _KERNEL_OPTIONS is None:
        _KERNEL_OPTIONS = _read_kernel_options()
    return _KERNEL_OPTIONS


def _read_kernel_options() -> tuple[dict, bool]:
    params = inspect.signature(_torch_varlen()).parameters
    if "window_size" in params:
        return {"window_size": (-1, 0)}, "enable_gqa" in params
    if "is_causal" in params:
        return {"is_causal": True}, "enable_gqa" in params
    raise TypeError(f"torch varlen_attn{inspect.signature(_torch_varlen())} has no causal option")


def _kernel_attention(q_THD, k_THD, v_THD, cu_seqlens, max_len: int, scale: float | None) -> torch.Tensor:
    """torch's FlashAttention-2 varlen kernel; GQA heads are expanded here where it takes no `enable_gqa`."""
    causal, takes_gqa = _kernel_options()
    kwargs = dict(causal)
    if k_THD.shape[1] != q_THD.shape[1]:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:
            group = q_THD.shape[1] // k_THD.shape[1]
            k_THD, v_THD = k_THD.repeat_interleave(group, 1), v_THD.repeat_interleave(group, 1)
    return _torch_varlen()(
        q_THD, k_THD, v_THD, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **kwargs
    )


def _reference_attention(q_THD, k_THD, v_THD, cu_seqlens, scale: float | None) -> torch.Tensor:
    """Causal sdpa on each sample's slice (CPU, and the fallback when the kernel is unusable)."""
    group = q_THD.shape[1] // k_THD.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in (q_THD, k_THD, v_THD))  # H x T x D
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs, 0)


def varlen_attention_forward(
    module: torch.nn.Module,
    query_BHLD: torch.Tensor,
    key_BHLD: torch.Tensor,
    value_BHLD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function (signature of `transformers.AttentionInterface`) over one packed row."""
    if cu_seq_lens_q is None or max_length_q is None or query_BHLD.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_ATTN} attention needs one packed row and its sample boundaries (cu_seq_lens_q, "
            f"max_length_q); got batch {query_BHLD.shape[0]}, cu_seq_lens_q {cu_seq_lens_q!r}. The actor "
            "passes them; for other callers use attn_implementation='sdpa'."
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query_BHLD, key_BHLD, value_BHLD))  # T x H x D
    if q.is_cuda and _torch_varlen() is not None:
        # HF's rotary embedding promotes q and k to the fp32 residual stream's dtype; flash takes bf16
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else v.dtype
        q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
        out = _kernel_attention(q, k, v, cu_seq_lens_q.to(torch.int32), max_length_q, scaling)
    else:
        out = _reference_attention(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None  # B x L x H x D, as HF's own attention functions return


def register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTN, varlen_attention_forward)
    if _torch_varlen() is not None:
        try:
            _kernel_options()  # now, before any layer is compiled
        except TypeError:
            pass  # a kernel without a causal option: varlen_kernel_works says no, and sdpa serves


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def varlen_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's varlen kernel runs here and matches per-sample sdpa, forward and backward, on a
    small GQA case (False on CPU, below torch 2.10, or where the kernel rejects the GPU or dtype)."""
    if device.type != "cuda" or _torch_varlen() is None:
        return False
    try:
        gen = torch.Generator(device).manual_seed(0)
        q, k, v = (
            torch.randn(40, heads, 64, device=device, dtype=dtype, generator=gen).requires_grad_()
            for heads in (6, 2, 2)
        )
        cu = torch.tensor([0, 17, 40], device=device, dtype=torch.int32)
        got = _kernel_attention(q, k, v, cu, 23, None)
        got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
        want = _reference_attention(q, k, v, cu, None)
        want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
        pairs = [(got, want), *zip(got_grads, want_grads, strict=True)]
        errors = [round(_relative_error(a, b), 5) for a, b in pairs]
    except Exception as exc:  # any failure of an optional fast path means: use the safe one
        log.warning("torch varlen attention unusable here (%s): the actor uses sdpa with padded rows", exc)
        return False
    if max(errors) < 2e-2:
        return True
    log.warning("torch varlen attention differs from sdpa here (relative errors %s): using sdpa", errors)
    return False
