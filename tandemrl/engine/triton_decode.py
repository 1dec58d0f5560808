"""Split-KV ("flash decoding") attention for decode steps: the context of each sequence is cut into
partitions handled by separate programs, whose partial results one combine pass merges.

It pays when few sequences have long contexts (the one-program-per-sequence kernel of `triton_attention`
then leaves most of the GPU idle); `triton_attention.tune_decode` times it against that kernel at engine
start. Same cache layout and semantics as `triton_attention`; a partition past a sequence's context does
nothing, so padded CUDA-graph batches stay valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandemrl.engine.triton_attention import DecodeConfig


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
