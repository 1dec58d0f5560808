"""A fused forward of `model.CausalLM` for the CUDA fast path: few kernels per layer for small decode steps.

At decode batch sizes a step is bound by kernel count as much as by bytes: the reference forward runs
about 40 kernels per layer (RMSNorm alone is eight). This forward runs nine: fused residual-add + RMSNorm,
one QKV GEMM, RoPE fused with the K/V cache write, the Triton attention (in a decode step one kernel
does RoPE, the K/V write and the attention: `triton_decode.rope_decode_attend`), the output GEMM, add + RMSNorm,
one gate/up GEMM, fused SiLU * up, the down GEMM. In a decode step the down GEMM may run as split-K fp32
partials that the next add + RMSNorm sums (`split_k_linear`, chosen per batch size by
`kernel_tuning.tune_down_split`), which saves cuBLAS's own split-K reduction kernel. The fused GEMMs read
concatenated weights; the HF-named parameters are re-pointed at slices of them (`fuse_projections`), so
`load_weights` (in-place copies) keeps updating exactly the tensors this forward reads, and the parameter
names stay HF's.
In a step with more tokens than sequences (a prefill), the last layer stores every token's K/V but runs
its attention output, o_proj and MLP for each sequence's last token only: nothing else reaches the logits.
Numerics follow the reference (bf16 rounding at the same places, fp32 inside the norms and RoPE), not
bit for bit; `tests/gpu/test_engine_fast_paths.py` compares the two forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandemrl.engine.model import CausalLM
from tandemrl.engine.pdl import use_pdl
from tandemrl.engine.triton_attention import FastMetadata


@triton.jit
def _add_rmsnorm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    stride_x,
    stride_part,
    stride_r,
    stride_o,
    N,
    eps,
    HAS_RES: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if NUM_PARTS == 1:
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    else:  # fp32 split-K partial products of a GEMM: their sum, rounded once, is the GEMM's output
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(NUM_PARTS):
            acc += tl.load(X + part * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        x = acc.to(Out.dtype.element_ty)
    if HAS_RES:
        x = x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(Out.dtype.element_ty)
        tl.store(ResOut + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + N + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)  # rounded like F.silu's bf16 output
    tl.store(Out + row * stride_o + cols, silu * up, mask=mask)


@triton.jit
def _embed_pending_kernel(Src, Pending, Ids, Embed, Out, stride_e, stride_o, D, BLOCK: tl.constexpr):
    """Row t's input id is Pending[Src[t]] when Src[t] >= 0 (a token sampled by the step before, not yet
    read by the host), else Ids[t]; its embedding row goes to Out[t]."""
    t = tl.program_id(0)
    src = tl.load(Src + t)
    token = tl.load(Ids + t)
    if src >= 0:
        token = tl.load(Pending + src)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    tl.store(Out + t * stride_o + cols, tl.load(Embed + token * stride_e + cols, mask=mask), mask=mask)


def embed_pending(
    src_B: torch.Tensor, pending_B: torch.Tensor, ids_B: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Embeddings of a decode step's input ids, where row t's id is `pending_B[src_B[t]]` if `src_B[t] >= 0`
    and `ids_B[t]` otherwise: one kernel where `where`, `clamp`, the gather and the embedding take five."""
    num_rows, dim = src_B.shape[0], weight.shape[1]
    out = torch.empty(num_rows, dim, dtype=weight.dtype, device=weight.device)
    _embed_pending_kernel[(num_rows,)](
        src_B,
        pending_B,
        ids_B,
        weight,
        out,
        weight.stride(0),
        out.stride(0),
        dim,
        BLOCK=triton.next_power_of_2(dim),
    )
    return out


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual, x itself is the new residual.
    A 3-D `x` holds fp32 split-K partials `[parts, rows, dim]` of a GEMM (see `split_k_linear`): their
    sum, rounded to the residual's dtype, is the input; it needs a residual."""
    parts = x.shape[0] if x.dim() == 3 else 1
    num_rows, dim = x.shape[-2:]
    assert parts == 1 or residual is not None, "split-K partials need a residual to add to"
    dtype = x.dtype if parts == 1 else residual.dtype
    out = torch.empty(num_rows, dim, dtype=dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else x
    pdl = use_pdl(x)
    res = residual if residual is not None else x
    _add_rmsnorm_kernel[(num_rows,)](
        x,
        res,
        weight,
        out,
        new_res,
        x.stride(-2),
        x.stride(0) if parts > 1 else 0,
        res.stride(0),
        out.stride(0),
        dim,
        eps,
        HAS_RES=residual is not None,
        NUM_PARTS=parts,
        BLOCK=triton.next_power_of_2(dim),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out, new_res


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """`x @ weight.T` as `parts` fp32 partial products over equal slices of K, `[parts, rows, out]`: one
    batched GEMM and no reduction kernel; `add_rmsnorm` sums the partials as it reads them. At decode
    batch sizes this beats cuBLAS's own split-K for the down projection, whose reduction is a kernel of
    its own (`kernel_tuning.tune_down_split` decides per batch size). The sum is rounded once, as cuBLAS
    rounds its own."""
    rows, k = x.shape
    return torch.bmm(
        x.view(rows, parts, k // parts).transpose(0, 1),
        weight.view(weight.shape[0], parts, k // parts).permute(1, 2, 0),
        out_dtype=torch.float32,
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_rows, width = gate_up.shape
    out = torch.empty(num_rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    block, pdl = 1024, use_pdl(gate_up)
    _silu_mul_kernel[(num_rows, triton.cdiv(width // 2, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=block, USE_PDL=pdl, launch_pdl=pdl
    )
    return out


@dataclass
class FusedWeights:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None


def _fuse(modules: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
    params = [getattr(m, attr) for m in modules]
    if any(p is None for p in params):
        assert all(p is None for p in params), f"mixed {attr} presence in fused projections"
        return None
    fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:  # the HF-named parameters become views of the fused tensor
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


def fuse_projections(model: CausalLM) -> list[FusedWeights]:
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        fused.append(
            FusedWeights(
                _fuse(qkv, "weight"), _fuse(qkv, "bias"), _fuse(gate_up, "weight"), _fuse(gate_up, "bias")
            )
        )
    return fused


def fast_forward(
    model: CausalLM,
    fused: list[FusedWeights],
    input_ids_T: torch.Tensor,
    positions_T: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: FastMetadata,
    down_split: int = 1,
    embeds_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """`CausalLM.forward`'s last-token logits over the Triton path, left in the model dtype: the lm_head
    rounded them already, and the GPU sampler reads them as they are (an fp32 copy would cost a pass).
    `down_split` > 1 runs the down projections as split-K partials that the next add + RMSNorm sums
    (`split_k_linear`; the projections must have no bias). `embeds_TD`, when given, are the embeddings of
    `input_ids_T` (`None` then), computed by the caller (a decode graph: `embed_pending`)."""
    x = model.model.embed_tokens(input_ids_T) if embeds_TD is None else embeds_TD
    cos, sin = model.rope.cos_sin_rows(positions_T, x.dtype)
    residual = None
    # Past the last layer's K/V only the last token of each sequence matters: when a step carries more
    # tokens than sequences (a prefill), that layer attends, projects and runs its MLP for those rows only.
    prune_last = x.shape[0] > meta.last_token_index.shape[0]
    last_layer = len(model.model.layers) - 1
    for index, (layer, weights, kv_cache) in enumerate(
        zip(model.model.layers, fused, kv_caches, strict=True)
    ):
        attn = layer.self_attn
        h, residual = add_rmsnorm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
        only_last = prune_last and index == last_layer
        x = _attention(attn, weights, h, cos, sin, kv_cache, meta, only_last)
        if only_last:
            residual = residual[meta.last_token_index]
        h, residual = add_rmsnorm(
            x, residual, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        )
        gate_up = F.linear(h, weights.gate_up_w, weights.gate_up_b)
        down = layer.mlp.down_proj
        act = silu_mul(gate_up)
        x = split_k_linear(act, down.weight, down_split) if down_split > 1 else down(act)
    # Unpruned, the step has one token per sequence (a decode step): every row is already a last token.
    h, _ = add_rmsnorm(x, residual, model.model.norm.weight, model.model.norm.eps)
    return model.lm_head(h)


def _attention(
    attn,
    weights: FusedWeights,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: FastMetadata,
    only_last: bool = False,
) -> torch.Tensor:
    """Self-attention of `h`'s tokens (every token's K/V is stored); with `only_last`, the output has one
    row per sequence: its last token's."""
    num_tokens, dim = h.shape[0], attn.head_dim
    qkv = F.linear(h, weights.qkv_w, weights.qkv_b)
    if attn.has_qk_norm:  # Qwen3: per-head RMSNorm before RoPE (the modules' own, unfused)
        q_size, k_size = attn.num_heads * dim, attn.num_kv_heads * dim
        q, k, v = qkv.split([q_size, k_size, k_size], dim=-1)
        q = attn.q_norm(q.reshape(num_tokens, attn.num_heads, dim)).reshape(num_tokens, q_size)
        k = attn.k_norm(k.reshape(num_tokens, attn.num_kv_heads, dim)).reshape(num_tokens, k_size)
        qkv = torch.cat([q, k, v], dim=-1)
    out = meta.rope_attend(qkv, cos, sin, kv_cache, attn.num_heads, dim**-0.5, only_last)
    return attn.o_proj(out.reshape(out.shape[0], attn.num_heads * dim))
