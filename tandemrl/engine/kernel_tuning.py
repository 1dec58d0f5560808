"""Start-up timing of the engine's tunable kernels on the engine's own cache and shapes (issue 9).

Which tile or kernel variant is fastest depends on the GPU, the model's head layout and the batch, so the
fast runner times each candidate once at start-up and keeps the fastest for the engine's life. The timings
only read the cache (slots of -1 write nothing), so tuning is safe at any time. A candidate must beat the
default by more than timing noise (5 %): otherwise runs of the same engine could pick different kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tandemrl.engine.attention_tiles import (
    DECODE_CANDIDATES,
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    PREFILL_CANDIDATES,
    DecodeConfig,
    PrefillConfig,
)
from tandemrl.engine.triton_attention import attend, decode_metadata


def fastest(candidates: tuple, timings: dict[str, float], default):
    best = min(candidates, key=lambda c: timings[str(c)])
    if timings[str(best)] > 0.95 * timings[str(default)]:
        return default  # within timing noise: keep the default, so runs pick the same kernel
    return best


def tune_decode(
    kv_caches: list[torch.Tensor], num_heads: int, batch: int, context_len: int, block_size: int
) -> tuple[DecodeConfig, dict[str, float]]:
    """Time each candidate's whole decode attention (RoPE and K/V store included, as a step runs it) on
    these caches' shape at (batch, context_len), in a CUDA graph as a step runs it (host-side timing is
    dominated by launch overhead at these tens of microseconds, and ranked the candidates unstably), one
    call per layer's cache as a step reads them (calls on one cache ranked two candidates equal that
    differ by 2-3 % over distinct caches); returns the fastest and every timing (ms per call)."""
    caches = kv_caches[:8]
    kv_cache = caches[0]
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
        timings[str(config)] = graph_ms(
            lambda i, m=meta: m.rope_attend(qkv, cos, sin, caches[i], num_heads, 0.1), len(caches)
        ) / len(caches)
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


def graph_ms(fn, calls: int, replays: int = 5) -> float:
    """Milliseconds per replay of a CUDA graph of `fn(i)` for i in range(calls), as a decode step runs
    its layers (timing in a graph leaves out the host launches, which a captured step does not pay).
    The benchmarks time with it too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for i in range(min(2, calls)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def split_candidates(in_features: int) -> tuple[int, ...]:
    """Split-K part counts for a GEMM over `in_features`: equal slices of whole 16-byte rows."""
    return tuple(p for p in (2, 3, 4, 5, 6, 7, 8) if in_features % (8 * p) == 0)


def tune_down_split(
    down_weights: list[torch.Tensor], norm_weight: torch.Tensor, batch_sizes: list[int], max_layers: int = 8
) -> tuple[dict[int, int], dict[str, float]]:
    """Per decode batch size, how many split-K parts the down projection runs in (1: `F.linear`, cuBLAS's
    choice), each candidate timed with the add + RMSNorm that consumes it, on the model's own weights
    (one per layer, as a step reads them, so none sits in L2). Returns {batch size: parts} and every
    timing (ms per `max_layers` layers, keyed "batch x parts")."""
    from tandemrl.engine.fast_layers import add_rmsnorm, split_k_linear

    weights = down_weights[:max_layers]
    out_features, in_features = weights[0].shape
    device, dtype = weights[0].device, weights[0].dtype

    def run(i: int, x: torch.Tensor, residual: torch.Tensor, parts: int):
        out = split_k_linear(x[i], weights[i], parts) if parts > 1 else F.linear(x[i], weights[i])
        return add_rmsnorm(out, residual, norm_weight, 1e-6)

    choices, timings = {}, {}
    candidates = (1, *split_candidates(in_features))
    for batch in batch_sizes:
        x = torch.randn(len(weights), batch, in_features, device=device, dtype=dtype)
        residual = torch.randn(batch, out_features, device=device, dtype=dtype)
        for parts in candidates:
            timings[f"{batch}x{parts}"] = graph_ms(
                lambda i, x=x, r=residual, p=parts: run(i, x, r, p), len(weights)
            )
        # a split must beat cuBLAS (1 part) by more than timing noise
        choices[batch] = fastest(candidates, {str(p): timings[f"{batch}x{p}"] for p in candidates}, 1)
    return choices, timings
