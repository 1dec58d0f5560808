"""Attention over the paged KV cache: the one place a GPU kernel replaces (issue 9).

Layout: each layer's cache is `[2, num_slots, num_kv_heads, head_dim]` (K then V), slot =
block_id * block_size + offset. A step's tokens arrive flat (`[T, heads, head_dim]`); their K/V are
first written to their slots, then each sequence attends to its whole context, gathered through its
block table into a padded batch and run through SDPA with a causal mask shifted by the cached length.
Invariant: query i of a sequence with `context_len` tokens of which `query_len` are new sees exactly
the keys at positions <= context_len - query_len + i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # cached + new tokens per sequence
    block_tables_BN: torch.Tensor  # padded with 0
    last_token_index: torch.Tensor  # [B] flat index of each sequence's last new token
    gather_slots_BL: torch.Tensor  # [B, Lmax] slots of every context position (padded)
    attn_mask_B1QL: torch.Tensor  # [B, 1, Qmax, Lmax] True where attention is allowed
    query_scatter_T: torch.Tensor  # flat token -> row of the padded [B * Qmax] query batch


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Index tensors shared by all layers of one step (built once per step, on the host)."""
    num_seqs = len(query_lens)
    max_q, max_ctx = max(query_lens), max(context_lens)
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    pos_L = torch.arange(max_ctx)
    blocks_BL = tables[:, torch.clamp(pos_L // block_size, max=max_blocks - 1)]
    gather_slots = blocks_BL * block_size + pos_L % block_size
    ctx = torch.tensor(context_lens)
    qlen = torch.tensor(query_lens)
    q_pos = (ctx - qlen)[:, None] + torch.arange(max_q)[None, :]  # [B, Qmax] absolute query positions
    mask = (pos_L[None, None, :] <= q_pos[:, :, None]) & (pos_L[None, None, :] < ctx[:, None, None])
    starts = torch.cumsum(qlen, 0) - qlen
    new_pos = [torch.arange(c - q, c) for q, c in zip(query_lens, context_lens, strict=True)]
    slot_mapping = torch.cat(
        [tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(new_pos)]
    )
    scatter = torch.cat([i * max_q + torch.arange(q) for i, q in enumerate(query_lens)])
    return AttentionMetadata(
        slot_mapping_T=slot_mapping.to(device),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables_BN=tables.to(device),
        last_token_index=(starts + qlen - 1).to(device),
        gather_slots_BL=gather_slots.to(device),
        attn_mask_B1QL=mask[:, None].to(device),
        query_scatter_T=scatter.to(device),
    )


def paged_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns `[T, heads, head_dim]`."""
    if not isinstance(meta, AttentionMetadata):  # the CUDA fast path's metadata brings its kernel (issue 9)
        return meta.attend(q_THD, k_TKD, v_TKD, kv_cache, scale)
    kv_cache[0, meta.slot_mapping_T] = k_TKD
    kv_cache[1, meta.slot_mapping_T] = v_TKD
    num_seqs, max_ctx = meta.gather_slots_BL.shape
    max_q = meta.attn_mask_B1QL.shape[2]
    num_heads, head_dim = q_THD.shape[1], q_THD.shape[2]
    num_kv_heads = k_TKD.shape[1]
    keys = kv_cache[0, meta.gather_slots_BL].transpose(1, 2)  # [B, Hkv, L, D]
    values = kv_cache[1, meta.gather_slots_BL].transpose(1, 2)
    group = num_heads // num_kv_heads
    q_pad = q_THD.new_zeros(num_seqs * max_q, num_heads, head_dim)
    q_pad[meta.query_scatter_T] = q_THD
    # Fold the query heads sharing a KV head into the query axis ([B, Hkv, G * Qmax, D]), so K/V are
    # never repeated: row (g, i) is query i of head kv * G + g and uses query i's mask.
    q_pad = q_pad.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q_pad = q_pad.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    mask = meta.attn_mask_B1QL.repeat(1, 1, group, 1) if group > 1 else meta.attn_mask_B1QL
    out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs * max_q, num_heads, head_dim)[meta.query_scatter_T]
