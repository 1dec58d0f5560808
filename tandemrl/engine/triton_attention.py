"""Paged attention on CUDA with Triton: the fast twin of `attention.paged_attention` (issue 9).

Same cache layout as the reference (`[2, num_slots, num_kv_heads, head_dim]`, slot = block * block_size +
offset) and the same semantics: a step's new K/V are written to their slots, then query i of a sequence
with `context_len` tokens of which `query_len` are new attends to the keys at positions <= context_len -
query_len + i. One kernel serves decode (one query per sequence) and ragged prefill (many): a program
owns one (sequence, KV head, query tile) and walks the sequence's block table with an online softmax, so
nothing is gathered or padded in memory. The query tile stacks the GQA heads that share the KV head, so
each K/V block is read once for all of them. Padding rows (a slot of -1, a context of 0) write nothing
and produce zeros, which is what lets CUDA graphs run a batch padded to a captured size.
Decode has tunable variants (`DecodeConfig`: tile sizes, or the split-KV kernel of `triton_decode`);
`kernel_tuning.tune_decode` times them on the engine's cache at start-up and the fastest serves every
decode step. Prefill tiles (`PrefillConfig`) are timed the same way by `kernel_tuning.tune_prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from tandemrl.engine.attention_tiles import DEFAULT_DECODE, DEFAULT_PREFILL, DecodeConfig, PrefillConfig
from tandemrl.engine.triton_rope import _rope_tables, _rotate

_DECODE_BLOCK_M = 16  # tl.dot needs >= 16 rows; one decode query x GQA group fits in it


@triton.jit
def _store_kv_kernel(
    K,
    V,
    Cache,
    Slots,
    stride_kt,
    stride_vt,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(Slots + token)
    offs = tl.arange(0, BLOCK)
    mask = (offs < NUM_ELEMS) & (slot >= 0)
    k = tl.load(K + token * stride_kt + offs, mask=mask)
    v = tl.load(V + token * stride_vt + offs, mask=mask)
    dest = Cache + slot * stride_c_slot + (offs // HEAD_DIM) * stride_c_head + offs % HEAD_DIM
    tl.store(dest, k, mask=mask)
    tl.store(dest + stride_c_kv, v, mask=mask)


@triton.jit
def _rope_store_kernel(
    QKV,
    Cos,
    Sin,
    QOut,
    Cache,
    Slots,
    stride_t,
    stride_cos,
    stride_qo,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_P2: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate q (to QOut) and k, then write k and v to the token's cache slot (none for slot -1)."""
    t = tl.program_id(0)
    half = tl.arange(0, HALF)
    cos1, cos2, sin1, sin2 = _rope_tables(Cos, Sin, t, stride_cos, HALF)
    heads = tl.arange(0, HEADS_P2)[:, None]
    hmask = heads < NUM_HEADS
    base = QKV + t * stride_t + heads * (2 * HALF) + half[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
    q1, q2 = _rotate(x1, x2, cos1, cos2, sin1, sin2)
    out = QOut + t * stride_qo + heads * (2 * HALF) + half[None, :]
    tl.store(out, q1.to(QOut.dtype.element_ty), mask=hmask)
    tl.store(out + HALF, q2.to(QOut.dtype.element_ty), mask=hmask)
    slot = tl.load(Slots + t)
    kv = tl.arange(0, KV_P2)[:, None]
    kmask = (kv < NUM_KV) & (slot >= 0)
    kbase = QKV + t * stride_t + NUM_HEADS * 2 * HALF + kv * (2 * HALF) + half[None, :]
    k1 = tl.load(kbase, mask=kmask, other=0.0).to(tl.float32)
    k2 = tl.load(kbase + HALF, mask=kmask, other=0.0).to(tl.float32)
    k1, k2 = _rotate(k1, k2, cos1, cos2, sin1, sin2)
    cache = Cache + slot * stride_c_slot + kv * stride_c_head + half[None, :]
    tl.store(cache, k1.to(Cache.dtype.element_ty), mask=kmask)
    tl.store(cache + HALF, k2.to(Cache.dtype.element_ty), mask=kmask)
    vbase = kbase + NUM_KV * 2 * HALF
    v1 = tl.load(vbase, mask=kmask, other=0.0)
    v2 = tl.load(vbase + HALF, mask=kmask, other=0.0)
    tl.store(cache + stride_c_kv, v1, mask=kmask)
    tl.store(cache + stride_c_kv + HALF, v2, mask=kmask)


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes every step: no recompiles
def _paged_attention_kernel(
    Q,
    Cache,
    Out,
    BlockTables,
    QueryStart,
    QueryLens,
    ContextLens,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    Tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILED: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if TILED:  # program 0's axis walks a table of (sequence, query tile) pairs; -1: a padding slot
        seq = tl.load(Tiles + 2 * tl.program_id(0))
        tile = tl.load(Tiles + 2 * tl.program_id(0) + 1)
        valid = seq >= 0
        seq = tl.maximum(seq, 0)  # a padding slot reads row 0's lengths, and with no queries reads no keys
        tile = tl.maximum(tile, 0)
    else:
        seq = tl.program_id(0)
        tile = tl.program_id(2)
        valid = seq >= 0
    queries_per_tile: tl.constexpr = BLOCK_M // GROUP
    q_len = tl.load(QueryLens + seq) * valid
    ctx = tl.load(ContextLens + seq)
    q_start = tl.load(QueryStart + seq)
    first_q = tile * queries_per_tile
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < queries_per_tile * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = ctx - q_len + q_idx  # absolute position of each row's query: it sees keys <= q_pos
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_end = ctx - q_len + first_q + queries_per_tile  # keys this tile can see
    kv_end = tl.minimum(kv_end, ctx)
    kv_end = kv_end * (first_q < q_len)  # a tile past its sequence's queries reads nothing
    k_base = Cache + kv_head * stride_c_head
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(BlockTables + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        offsets = slot[:, None] * stride_c_slot + dims[None, :]
        k = tl.load(k_base + offsets, mask=pos_ok[:, None], other=0.0)
        v = tl.load(k_base + stride_c_kv + offsets, mask=pos_ok[:, None], other=0.0)  # both in flight
        s = tl.dot(q, tl.trans(k)) * scale
        allowed = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )


def store_kv(k_TKD: torch.Tensor, v_TKD: torch.Tensor, kv_cache: torch.Tensor, slots_T: torch.Tensor) -> None:
    """Write each token's K/V to its slot; tokens with slot -1 (padding) are skipped."""
    num_tokens = k_TKD.shape[0]
    k_flat, v_flat = k_TKD.reshape(num_tokens, -1), v_TKD.reshape(num_tokens, -1)
    assert k_flat.stride(1) == 1 and v_flat.stride(1) == 1 and kv_cache.stride(3) == 1
    num_elems = k_flat.shape[1]
    _store_kv_kernel[(num_tokens,)](
        k_flat,
        v_flat,
        kv_cache,
        slots_T,
        k_flat.stride(0),
        v_flat.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        HEAD_DIM=kv_cache.shape[3],
        NUM_ELEMS=num_elems,
        BLOCK=triton.next_power_of_2(num_elems),
    )


def rope_store(
    qkv_TF: torch.Tensor,
    cos_TD: torch.Tensor,
    sin_TD: torch.Tensor,
    kv_cache: torch.Tensor,
    slots_T: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Rotate the fused QKV output's q and k; k and v go to their cache slots (none for slot -1), the
    rotated queries are returned `[T, heads, head_dim]`."""
    num_tokens, (num_kv_heads, dim) = qkv_TF.shape[0], kv_cache.shape[2:]
    q = torch.empty(num_tokens, num_heads, dim, dtype=qkv_TF.dtype, device=qkv_TF.device)
    _rope_store_kernel[(num_tokens,)](
        qkv_TF,
        cos_TD,
        sin_TD,
        q,
        kv_cache,
        slots_T,
        qkv_TF.stride(0),
        cos_TD.stride(0),
        q.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_heads),
        KV_P2=triton.next_power_of_2(num_kv_heads),
        HALF=dim // 2,
        num_warps=4,
    )
    return q


def attend(
    q_THD: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables_BW: torch.Tensor,
    query_start_B: torch.Tensor,
    query_lens_B: torch.Tensor,
    context_lens_B: torch.Tensor,
    max_query_len: int,
    block_size: int,
    scale: float,
    config: DecodeConfig = DEFAULT_DECODE,
    prefill: PrefillConfig = DEFAULT_PREFILL,
) -> torch.Tensor:
    """Attention of the flat queries `[T, heads, head_dim]` over the cache (K/V already stored)."""
    num_heads, num_kv_heads = q_THD.shape[1], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_query_len == 1:
        block_m = max(_DECODE_BLOCK_M, triton.next_power_of_2(group))
        tiles = (config.block_n, config.num_warps, config.num_stages)
    else:
        block_m = prefill_block_m(num_heads, num_kv_heads, prefill)
        tiles = (prefill.block_n, prefill.num_warps, prefill.num_stages)
    grid = (query_lens_B.shape[0], num_kv_heads, triton.cdiv(max_query_len, block_m // group))
    # Tiles (unused unless TILED): any int64 tensor
    args = (q_THD, kv_cache, block_tables_BW, query_start_B, query_lens_B, context_lens_B, query_lens_B)
    return _paged_attention(grid, *args, scale, block_size, block_m, *tiles, tiled=False)


def prefill_block_m(num_heads: int, num_kv_heads: int, prefill: PrefillConfig) -> int:
    """Rows of a prefill program's query tile: queries x the GQA group, at least the group."""
    return max(prefill.block_m, triton.next_power_of_2(num_heads // num_kv_heads))


def attend_tiles(
    q_THD: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables_BW: torch.Tensor,
    query_start_B: torch.Tensor,
    query_lens_B: torch.Tensor,
    context_lens_B: torch.Tensor,
    tiles_N2: torch.Tensor,
    block_size: int,
    scale: float,
    prefill: PrefillConfig = DEFAULT_PREFILL,
) -> torch.Tensor:
    """`attend` of a prefill step over a table of (sequence, query tile) pairs (`attention_tiles.tile_table`,
    built on the host for the step's query lengths), one program per pair and KV head: the grid is the
    table's length, fixed for a captured prefill graph (engine/prefill_graphs.py) whatever the step's
    ragged lengths; padding pairs (-1) read and write nothing."""
    num_heads, num_kv_heads = q_THD.shape[1], kv_cache.shape[2]
    grid = (tiles_N2.shape[0], num_kv_heads, 1)
    args = (q_THD, kv_cache, block_tables_BW, query_start_B, query_lens_B, context_lens_B, tiles_N2)
    block_m = prefill_block_m(num_heads, num_kv_heads, prefill)
    tiles = (prefill.block_n, prefill.num_warps, prefill.num_stages)
    return _paged_attention(grid, *args, scale, block_size, block_m, *tiles, tiled=True)


def _paged_attention(
    grid: tuple[int, int, int],
    q_THD: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables_BW: torch.Tensor,
    query_start_B: torch.Tensor,
    query_lens_B: torch.Tensor,
    context_lens_B: torch.Tensor,
    tiles_N2: torch.Tensor,
    scale: float,
    block_size: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    tiled: bool,
) -> torch.Tensor:
    """One launch of `_paged_attention_kernel` over `grid` (`attend`'s per-sequence tiles, or
    `attend_tiles`'s table)."""
    out = torch.empty_like(q_THD)
    _paged_attention_kernel[grid](
        q_THD,
        kv_cache,
        out,
        block_tables_BW,
        query_start_B,
        query_lens_B,
        context_lens_B,
        scale,
        q_THD.stride(0),
        q_THD.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables_BW.stride(0),
        tiles_N2,
        GROUP=q_THD.shape[1] // kv_cache.shape[2],
        HEAD_DIM=q_THD.shape[2],
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        TILED=tiled,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@dataclass
class FastMetadata:
    """Attention inputs of one step for the Triton path; `attention.paged_attention` hands over to it."""

    slot_mapping_T: torch.Tensor  # int64, -1 = padding token (writes nothing)
    query_start_B: torch.Tensor  # int64 flat index of each sequence's first new token
    query_lens_B: torch.Tensor  # int64
    context_lens_B: torch.Tensor  # int64, 0 = padding sequence
    block_tables_BW: torch.Tensor  # int64 block ids, padded with 0
    last_token_index: torch.Tensor  # [B] flat index of each sequence's last new token
    max_query_len: int
    block_size: int
    max_context_len: int  # bounds the decode split count (static under CUDA graphs)
    decode: DecodeConfig = DEFAULT_DECODE
    prefill: PrefillConfig = DEFAULT_PREFILL
    # a prefill graph's (sequence, query tile) table (`attend_tiles`); None: the grid of `attend`
    tiles_N2: torch.Tensor | None = None

    def attend(
        self,
        q_THD: torch.Tensor,
        k_TKD: torch.Tensor,
        v_TKD: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k_TKD, v_TKD, kv_cache, self.slot_mapping_T)
        return self.attend_stored(q_THD.contiguous(), kv_cache, scale)

    def rope_attend(
        self,
        qkv_TF: torch.Tensor,
        cos_TD: torch.Tensor,
        sin_TD: torch.Tensor,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        only_last: bool = False,
    ) -> torch.Tensor:
        """Attention straight from the fused QKV output: RoPE, the K/V store, then the attention (one kernel
        for all three in a decode step); with `only_last`, one output row per sequence, its last token's.
        The fused decode kernel multiplies half-heads (`tl.dot` needs K >= 16): heads under 32 take the
        RoPE + store kernel and then the attention."""
        if self.max_query_len == 1 and not self.decode.split and kv_cache.shape[-1] >= 32:
            from tandemrl.engine.triton_decode import rope_decode_attend

            return rope_decode_attend(
                qkv_TF,
                cos_TD,
                sin_TD,
                kv_cache,
                self.slot_mapping_T,
                self.block_tables_BW,
                self.context_lens_B,
                num_heads,
                self.block_size,
                scale,
                self.decode,
            )
        q = rope_store(qkv_TF, cos_TD, sin_TD, kv_cache, self.slot_mapping_T, num_heads)
        if only_last:
            return self.attend_last(q[self.last_token_index], kv_cache, scale)
        return self.attend_stored(q, kv_cache, scale)

    def attend_stored(self, q_THD: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention once this step's K/V are in the cache: split-KV decode, or the ragged kernel."""
        if self.max_query_len == 1:
            return self._attend_one_query(q_THD, kv_cache, scale, self.query_start_B, self.query_lens_B)
        if self.tiles_N2 is not None:
            return attend_tiles(
                q_THD,
                kv_cache,
                self.block_tables_BW,
                self.query_start_B,
                self.query_lens_B,
                self.context_lens_B,
                self.tiles_N2,
                self.block_size,
                scale,
                self.prefill,
            )
        return attend(
            q_THD,
            kv_cache,
            self.block_tables_BW,
            self.query_start_B,
            self.query_lens_B,
            self.context_lens_B,
            self.max_query_len,
            self.block_size,
            scale,
            self.decode,
            self.prefill,
        )

    def attend_last(self, q_BHD: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of each sequence's last query only (`q_BHD`: one row per sequence, in order), once the
        step's K/V are stored: a decode-shaped call, whatever the step's query lengths."""
        rows = torch.arange(q_BHD.shape[0], device=q_BHD.device)
        return self._attend_one_query(q_BHD, kv_cache, scale, rows, torch.ones_like(rows))

    def _attend_one_query(self, q_BHD, kv_cache, scale, query_start_B, query_lens_B) -> torch.Tensor:
        if self.decode.split:
            from tandemrl.engine.triton_decode import decode_attend

            return decode_attend(
                q_BHD,
                kv_cache,
                self.block_tables_BW,
                self.context_lens_B,
                self.max_context_len,
                self.block_size,
                scale,
                self.decode,
            )
        return attend(
            q_BHD,
            kv_cache,
            self.block_tables_BW,
            query_start_B,
            query_lens_B,
            self.context_lens_B,
            1,
            self.block_size,
            scale,
            self.decode,
        )


def decode_metadata(
    block_tables_BW: torch.Tensor,
    context_lens_B: torch.Tensor,
    max_context_len: int,
    block_size: int,
    config: DecodeConfig,
) -> FastMetadata:
    """Metadata of a decode step over given block tables and context lengths (row b is sequence b), for
    timing: every slot is -1, so the step writes no K/V and leaves the cache as it found it."""
    rows = torch.arange(context_lens_B.shape[0], device=context_lens_B.device)
    return FastMetadata(
        slot_mapping_T=torch.full_like(rows, -1),
        query_start_B=rows,
        query_lens_B=torch.ones_like(rows),
        context_lens_B=context_lens_B,
        block_tables_BW=block_tables_BW,
        last_token_index=rows,
        max_query_len=1,
        block_size=block_size,
        max_context_len=max_context_len,
        decode=config,
    )


@dataclass
class HostMetadata:
    """An eager step's attention metadata as one int64 host array (slots | query starts | query lengths |
    context lengths | last-token indices | block tables), which the runner copies to the GPU together
    with the step's other inputs (one copy from a pinned buffer); `on_device` views the copied array."""

    ints: np.ndarray
    num_tokens: int
    num_seqs: int
    width: int
    max_query_len: int
    max_context_len: int

    def on_device(
        self,
        dev: torch.Tensor,
        block_size: int,
        decode: DecodeConfig = DEFAULT_DECODE,
        prefill: PrefillConfig = DEFAULT_PREFILL,
    ) -> FastMetadata:
        b = self.num_seqs
        parts = torch.split(dev, [self.num_tokens, b, b, b, b, b * self.width])
        return FastMetadata(
            slot_mapping_T=parts[0],
            query_start_B=parts[1],
            query_lens_B=parts[2],
            context_lens_B=parts[3],
            last_token_index=parts[4],
            block_tables_BW=parts[5].view(b, self.width),
            max_query_len=self.max_query_len,
            block_size=block_size,
            max_context_len=self.max_context_len,
            decode=decode,
            prefill=prefill,
        )


def host_metadata(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> HostMetadata:
    num_seqs = len(query_lens)
    width = max(len(t) for t in block_tables)
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    slots = []
    for i, (table, q_len, ctx) in enumerate(zip(block_tables, query_lens, context_lens, strict=True)):
        tables[i, : len(table)] = table
        positions = np.arange(ctx - q_len, ctx)
        slots.append(tables[i, positions // block_size] * block_size + positions % block_size)
    qlens = np.asarray(query_lens, dtype=np.int64)
    starts = np.cumsum(qlens) - qlens
    ints = np.concatenate(
        [*slots, starts, qlens, np.asarray(context_lens, dtype=np.int64), starts + qlens - 1, tables.ravel()]
    )
    return HostMetadata(ints, int(qlens.sum()), num_seqs, width, max(query_lens), max(context_lens))


def build_fast_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    decode: DecodeConfig = DEFAULT_DECODE,
    prefill: PrefillConfig = DEFAULT_PREFILL,
) -> FastMetadata:
    """Host-built metadata for an eager (not graph-captured) step, copied to `device` on its own."""
    host = host_metadata(query_lens, context_lens, block_tables, block_size)
    ints = torch.from_numpy(host.ints)
    is_cuda = torch.device(device).type == "cuda"
    dev = ints.pin_memory().to(device, non_blocking=True) if is_cuda else ints.to(device)
    return host.on_device(dev, block_size, decode, prefill)
