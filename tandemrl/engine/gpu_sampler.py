"""Greedy / temperature sampling on the GPU without a host sync, exact by inverting the CDF.

Two kernels. `_partial_kernel`: each program owns one (row, vocabulary chunk) and reduces it to its max
logit (with the first column that holds it) and the sum of exp(logit - max), keeping that state per
lane until its end, so the loop needs no cross-lane reduction. `_select_kernel`: per row, the chunk
sums give the softmax's normaliser; one uniform draw u * total picks the chunk whose cumulative mass
crosses it, and a scan of that chunk alone picks the token. So each logit costs a load and two exps
(no random number per logit, as Gumbel-max would need), and the draw of a row depends on (seed, row)
only, not on the batch. Logits are read in their own dtype (bf16 on the fast path: the lm_head already
rounded them, an fp32 copy adds nothing). Same convention as `sampler.sample`: a sampled token's logprob
is log softmax(logits / T) at it; greedy rows (T = 0) take the first argmax and report the T = 1
log-softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LANES = 1024
_STEPS = 8  # 8,192 logits per chunk: 19 chunks per row for a 152k vocabulary
_SCAN = 1024  # logits per iteration of the in-chunk scan


@triton.jit
def _scaled(Logits, row, stride, V, cols, inv_t):
    return tl.load(Logits + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _inv_temperature(Temps, row):
    temp = tl.load(Temps + row)
    greedy = temp == 0.0
    return tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp)), greedy


@triton.jit
def _partial_kernel(
    Logits, Temps, PartMax, PartSum, PartIdx, stride, V, NUM_CHUNKS, LANES: tl.constexpr, STEPS: tl.constexpr
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t, _ = _inv_temperature(Temps, row)
    lanes = tl.arange(0, LANES)
    m = tl.full([LANES], float("-inf"), tl.float32)
    s = tl.zeros([LANES], tl.float32)
    idx = tl.zeros([LANES], tl.int32)
    for step in range(STEPS):
        cols = (chunk * STEPS + step) * LANES + lanes
        x = _scaled(Logits, row, stride, V, cols, inv_t)
        idx = tl.where(x > m, cols, idx)  # strict: a lane keeps the first column of its max
        new_m = tl.maximum(m, x)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # a lane that has seen no logit yet
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = new_m
    top = tl.max(m, 0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    part = row * NUM_CHUNKS + chunk
    tl.store(PartMax + part, top)
    tl.store(PartSum + part, tl.sum(s * tl.exp(m - safe), 0))
    tl.store(PartIdx + part, tl.min(tl.where(m == top, idx, 2147483647), 0))


@triton.jit
def _select_kernel(
    Logits,
    Temps,
    Seed,
    PartMax,
    PartSum,
    PartIdx,
    OutIds,
    OutLogprobs,
    stride,
    V,
    NUM_CHUNKS,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    SCAN: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t, greedy = _inv_temperature(Temps, row)
    chunks = tl.arange(0, CHUNKS_P2)
    ok = chunks < NUM_CHUNKS
    part = row * NUM_CHUNKS + chunks
    m = tl.load(PartMax + part, mask=ok, other=float("-inf"))
    top = tl.max(m, 0)
    mass = tl.where(m == float("-inf"), 0.0, tl.load(PartSum + part, mask=ok, other=0.0) * tl.exp(m - top))
    total = tl.sum(mass, 0)
    first_max = tl.argmax(m, 0)  # chunks run in column order: the first chunk holding the max
    greedy_id = tl.sum(tl.where(chunks == first_max, tl.load(PartIdx + part, mask=ok, other=0), 0), 0)
    # Sampling: the chunk where the cumulative mass first exceeds u, then the token inside it.
    two = tl.arange(0, 2)  # tl.rand draws a block: take the first of two
    u = tl.sum(tl.where(two == 0, tl.rand(tl.load(Seed), 2 * row + two), 0.0), 0) * total
    cum = tl.cumsum(mass, 0)
    crossed = ok & (cum > u)
    pick = tl.min(tl.where(crossed, chunks, NUM_CHUNKS - 1), 0)
    rest = u - tl.sum(tl.where(chunks == pick, cum - mass, 0.0), 0)
    found = tl.full([], -1, tl.int32)
    last_positive = tl.full([], -1, tl.int32)  # if rounding leaves `rest` past the chunk's own sum
    running = tl.zeros([], tl.float32)
    for start in range(0, CHUNK, SCAN):
        cols = pick * CHUNK + start + tl.arange(0, SCAN)
        e = tl.exp(_scaled(Logits, row, stride, V, cols, inv_t) - top)
        inside = running + tl.cumsum(e, 0)
        hit = tl.min(tl.where(inside > rest, cols, 2147483647), 0)
        found = tl.where((found < 0) & (hit < 2147483647), hit, found)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(e > 0.0, cols, -1), 0))
        running += tl.sum(e, 0)
    sampled = tl.where(found >= 0, found, last_positive)
    token = tl.where(greedy, greedy_id, sampled)
    x = tl.load(Logits + row * stride + token).to(tl.float32) * inv_t
    tl.store(OutIds + row, token.to(tl.int64))
    tl.store(OutLogprobs + row, x - top - tl.log(total))


def fused_sample(
    logits_BV: torch.Tensor,
    temperatures_B: torch.Tensor,
    seed: torch.Tensor,
    out_ids: torch.Tensor | None = None,
    out_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row (see the module doc); `seed` is a one-element int64 tensor on the device.
    Writes into `out_ids` (int64) / `out_logprobs` (fp32) when given, so a CUDA graph can own them."""
    num_rows, vocab = logits_BV.shape
    device = logits_BV.device
    ids = out_ids if out_ids is not None else torch.empty(num_rows, dtype=torch.long, device=device)
    logprobs = (
        out_logprobs
        if out_logprobs is not None
        else torch.empty(num_rows, dtype=torch.float32, device=device)
    )
    chunk = _LANES * _STEPS
    num_chunks = triton.cdiv(vocab, chunk)
    part_max = torch.empty(num_rows * num_chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(num_rows * num_chunks, dtype=torch.int32, device=device)
    _partial_kernel[(num_rows, num_chunks)](
        logits_BV,
        temperatures_B,
        part_max,
        part_sum,
        part_idx,
        logits_BV.stride(0),
        vocab,
        num_chunks,
        LANES=_LANES,
        STEPS=_STEPS,
        num_warps=4,
    )
    _select_kernel[(num_rows,)](
        logits_BV,
        temperatures_B,
        seed,
        part_max,
        part_sum,
        part_idx,
        ids,
        logprobs,
        logits_BV.stride(0),
        vocab,
        num_chunks,
        CHUNK=chunk,
        CHUNKS_P2=max(2, triton.next_power_of_2(num_chunks)),
        SCAN=_SCAN,
        num_warps=4,
    )
    return ids, logprobs
