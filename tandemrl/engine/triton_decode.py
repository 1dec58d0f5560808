"""Split-KV ("flash decoding") attention for decode steps: the context of each sequence is cut into
partitions handled by separate programs, whose partial results one combine pass merges.

It pays when few sequences have long contexts (the one-program-per-sequence kernel of `triton_attention`
then leaves most of the GPU idle); `kernel_tuning.tune_decode` times it against that kernel at engine
start. Same cache layout and semantics as `triton_attention`; a partition past a sequence's context does
nothing, so padded CUDA-graph batches stay valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandemrl.engine.attention_tiles import DecodeConfig
from tandemrl.engine.pdl import use_pdl
from tandemrl.engine.triton_rope import _rope_tables, _rotate


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    Q,
    Cache,
    BlockTables,
    ContextLens,
    PartialO,
    PartialML,
    scale,
    stride_qt,
    stride_qh,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Decode (one query per sequence): program (seq, kv head, split) covers PARTITION context tokens and
    writes its unnormalised output and (max, sum) for `_combine_kernel`; splits past the context do nothing."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + seq)
    first = split * PARTITION
    if first < ctx:
        rows = tl.arange(0, BLOCK_M)
        head = kv_head * GROUP + rows
        row_ok = rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + seq * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0
        )
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        end = tl.minimum(ctx, first + PARTITION)
        k_base = Cache + kv_head * stride_c_head
        for start in range(first, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
            block = tl.load(BlockTables + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            offsets = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_c_slot + dims[None, :]
            k = tl.load(k_base + offsets, mask=pos_ok[:, None], other=0.0)
            v = tl.load(k_base + stride_c_kv + offsets, mask=pos_ok[:, None], other=0.0)
            s = tl.where(pos_ok[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk has a valid key
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        part = (seq * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(PartialO + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(PartialML + part * 2, m_i, mask=row_ok)
        tl.store(PartialML + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    PartialO,
    PartialML,
    Out,
    ContextLens,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)
    splits = tl.arange(0, SPLITS_P2)
    active = (splits * PARTITION < ctx) & (splits < NUM_SPLITS)
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(PartialML + part * 2, mask=active, other=float("-inf"))
    l_split = tl.load(PartialML + part * 2 + 1, mask=active, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(active, tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)), 0.0)
    total = tl.sum(weight * l_split, 0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(PartialO + part[:, None] * HEAD_DIM + dims[None, :], mask=active[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + seq * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty))


def decode_attend(
    q_BHD: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables_BW: torch.Tensor,
    context_lens_B: torch.Tensor,
    max_context_len: int,
    block_size: int,
    scale: float,
    config: DecodeConfig,
) -> torch.Tensor:
    """Split-KV ("flash decoding") attention for one query per sequence: many small programs keep enough
    loads in flight to approach memory bandwidth, then one combine pass per (sequence, head)."""
    num_seqs, num_heads, head_dim = q_BHD.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    num_splits = max(1, triton.cdiv(max_context_len, config.partition))
    partial_o = torch.empty(
        num_seqs * num_heads * num_splits * head_dim, dtype=torch.float32, device=q_BHD.device
    )
    partial_ml = torch.empty(num_seqs * num_heads * num_splits * 2, dtype=torch.float32, device=q_BHD.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q_BHD,
        kv_cache,
        block_tables_BW,
        context_lens_B,
        partial_o,
        partial_ml,
        scale,
        q_BHD.stride(0),
        q_BHD.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables_BW.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        PARTITION=config.partition,
        NUM_SPLITS=num_splits,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    out = torch.empty_like(q_BHD)
    _combine_kernel[(num_seqs, num_heads)](
        partial_o,
        partial_ml,
        out,
        context_lens_B,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PARTITION=config.partition,
        NUM_SPLITS=num_splits,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["stride_bt"])
def _rope_decode_kernel(
    QKV,
    Cos,
    Sin,
    Cache,
    Out,
    Slots,
    BlockTables,
    ContextLens,
    scale,
    stride_t,
    stride_cos,
    stride_ot,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Decode step, program (seq, kv head): rotate the token's query heads of this group and its key, store
    the key and value to the token's slot (none for slot -1), and attend to the cached context plus the
    new key, which joins the online softmax from registers (no read after the write). Rounding follows the
    unfused path: rotated q and k in the cache dtype, softmax weights in that dtype before the V product."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)  # includes the new token; 0 = padding row
    half = tl.arange(0, HALF)
    cos1, cos2, sin1, sin2 = _rope_tables(Cos, Sin, seq, stride_cos, HALF)
    slot = tl.load(Slots + seq)
    if USE_PDL:  # everything above is a step input; the QKV output comes from the kernel before
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    q_ptr = QKV + seq * stride_t + head[:, None] * (2 * HALF) + half[None, :]
    x1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    dtype = Cache.dtype.element_ty
    q1, q2 = _rotate(x1, x2, cos1, cos2, sin1, sin2)
    q1, q2 = q1.to(dtype), q2.to(dtype)
    k_ptr = QKV + seq * stride_t + (NUM_HEADS + kv_head) * (2 * HALF) + half
    k1 = tl.load(k_ptr).to(tl.float32)
    k2 = tl.load(k_ptr + HALF).to(tl.float32)
    new_k1, new_k2 = _rotate(k1, k2, cos1, cos2, sin1, sin2)
    new_k1, new_k2 = new_k1.to(dtype), new_k2.to(dtype)
    v_ptr = k_ptr + NUM_KV * (2 * HALF)
    new_v1 = tl.load(v_ptr)
    new_v2 = tl.load(v_ptr + HALF)
    if slot >= 0:
        dest = Cache + slot * stride_c_slot + kv_head * stride_c_head + half
        tl.store(dest, new_k1)
        tl.store(dest + HALF, new_k2)
        tl.store(dest + stride_c_kv, new_v1)
        tl.store(dest + stride_c_kv + HALF, new_v2)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    k_base = Cache + kv_head * stride_c_head
    num_cached = ctx - 1
    for start in range(0, num_cached, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < num_cached
        block = tl.load(BlockTables + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        offsets = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_c_slot + half[None, :]
        ka = tl.load(k_base + offsets, mask=pos_ok[:, None], other=0.0)
        kb = tl.load(k_base + HALF + offsets, mask=pos_ok[:, None], other=0.0)
        va = tl.load(k_base + stride_c_kv + offsets, mask=pos_ok[:, None], other=0.0)
        vb = tl.load(k_base + stride_c_kv + HALF + offsets, mask=pos_ok[:, None], other=0.0)
        s = tl.dot(q1, tl.trans(ka)) + tl.dot(q2, tl.trans(kb))
        s = tl.where(pos_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk has a valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(dtype)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, va)
        acc2 = acc2 * alpha[:, None] + tl.dot(p, vb)
        m_i = m_new
    # The new token's key, from registers (a padding row has no keys at all: its output stays zero).
    s_new = tl.sum(q1.to(tl.float32) * new_k1.to(tl.float32)[None, :], 1)
    s_new += tl.sum(q2.to(tl.float32) * new_k2.to(tl.float32)[None, :], 1)
    s_new = tl.where(ctx > 0, s_new * scale, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p_new = tl.exp(s_new - m_safe)
    l_i = l_i * alpha + p_new
    p_new = p_new.to(dtype).to(tl.float32)
    acc1 = acc1 * alpha[:, None] + p_new[:, None] * new_v1.to(tl.float32)[None, :]
    acc2 = acc2 * alpha[:, None] + p_new[:, None] * new_v2.to(tl.float32)[None, :]
    norm = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptr = Out + seq * stride_ot + head[:, None] * (2 * HALF) + half[None, :]
    tl.store(out_ptr, (acc1 / norm).to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(out_ptr + HALF, (acc2 / norm).to(Out.dtype.element_ty), mask=row_ok[:, None])


def rope_decode_attend(
    qkv_TF: torch.Tensor,
    cos_TD: torch.Tensor,
    sin_TD: torch.Tensor,
    kv_cache: torch.Tensor,
    slots_T: torch.Tensor,
    block_tables_BW: torch.Tensor,
    context_lens_B: torch.Tensor,
    num_heads: int,
    block_size: int,
    scale: float,
    config: DecodeConfig,
) -> torch.Tensor:
    """A decode step's RoPE, K/V store and attention in one kernel, straight from the fused QKV output
    (token t is sequence t); returns `[T, heads, head_dim]`. One launch per layer instead of two, and the
    rotated queries never leave registers."""
    num_tokens = qkv_TF.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3]
    assert qkv_TF.stride(1) == 1 and kv_cache.stride(3) == 1 and cos_TD.stride(1) == 1
    assert num_tokens == context_lens_B.shape[0], "a decode step has one token per sequence"
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv_TF.dtype, device=qkv_TF.device)
    pdl = use_pdl(qkv_TF)
    _rope_decode_kernel[(num_tokens, num_kv_heads)](
        qkv_TF,
        cos_TD,
        sin_TD,
        kv_cache,
        out,
        slots_T,
        block_tables_BW,
        context_lens_B,
        scale,
        qkv_TF.stride(0),
        cos_TD.stride(0),
        out.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables_BW.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV=num_kv_heads,
        GROUP=group,
        HALF=head_dim // 2,
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out
