"""Start-up timing of the engine's tunable kernels on the engine's own cache and shapes (issue 9).

Which tile or kernel variant is fastest depends on the GPU, the model's head layout and the batch, so the
fast runner times each candidate once at start-up and keeps the fastest for the engine's life. The timings
only read the cache (slots of -1 write nothing), so tuning is safe at any time. A candidate must beat the
default by more than timing noise (5 %): otherwise runs of the same engine could pick different kernels.
"""

from __future__ import annotations

import torch
import triton

from tandemrl.engine.triton_attention import (
    DECODE_CANDIDATES,
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    PREFILL_CANDIDATES,
    DecodeConfig,
    PrefillConfig,
    attend,
    decode_metadata,
)


def fastest(candidates: tuple, timings: dict[str, float], default):
    best = min(candidates, key=lambda c: timings[str(c)])
    if timings[str(best)] > 0.95 * timings[str(default)]:
        return default  # within timing noise: keep the default, so runs pick the same kernel
    return best


def tune_decode(
    kv_cache: torch.Tensor, num_heads: int, batch: int, context_len: int, block_size: int
) -> tuple[DecodeConfig, dict[str, float]]:
    """Time each candidate's whole decode attention (RoPE and K/V store included, as a step runs it) on
    this cache's shape at (batch, context_len); returns the fastest and every timing (ms)."""
    from triton.testing import do_bench

    device, dtype = kv_cache.device, kv_cache.dtype
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = kv_cache.shape[1] // block_size
    width = triton.cdiv(context_len, block_size)
    tables = torch.randint(0, num_blocks, (batch, width), device=device)
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype)
    angles = torch.rand(batch, head_dim, device=device) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ctx = torch.full((batch,), context_len, dtype=torch.long, device=device)
    timings = {}
    for config in DECODE_CANDIDATES:
        meta = decode_metadata(tables, ctx, context_len, block_size, config)
        timings[str(config)] = do_bench(
            lambda m=meta: m.rope_attend(qkv, cos, sin, kv_cache, num_heads, 0.1), warmup=5, rep=20
        )
    return fastest(DECODE_CANDIDATES, timings, DEFAULT_DECODE), timings


def tune_prefill(
    kv_cache: torch.Tensor, num_heads: int, num_tokens: int, prompt_len: int, block_size: int
) -> tuple[PrefillConfig, dict[str, float]]:
    """Time each candidate prefill tiling on fresh prompts of `prompt_len` tokens filling `num_tokens`;
    returns the fastest and every timing (ms)."""
    from triton.testing import do_bench

    device = kv_cache.device
    num_seqs = max(1, num_tokens // prompt_len)
    num_blocks = kv_cache.shape[1] // block_size
    width = triton.cdiv(prompt_len, block_size)
    tables = torch.randint(0, num_blocks, (num_seqs, width), device=device)
    q = torch.randn(num_seqs * prompt_len, num_heads, kv_cache.shape[3], device=device, dtype=kv_cache.dtype)
    lens = torch.full((num_seqs,), prompt_len, dtype=torch.long, device=device)
    starts = torch.arange(num_seqs, device=device) * prompt_len
    timings = {}
    for config in PREFILL_CANDIDATES:
        timings[str(config)] = do_bench(
            lambda c=config: attend(
                q, kv_cache, tables, starts, lens, lens, prompt_len, block_size, 0.1, prefill=c
            ),
            warmup=5,
            rep=20,
        )
    return fastest(PREFILL_CANDIDATES, timings, DEFAULT_PREFILL), timings
