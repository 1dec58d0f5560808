"""The decode MLP tail in two Triton kernels: SiLU * up fused into a split-K down_proj, whose fp32 partial sums
the next residual-add + RMSNorm adds up.

It replaces `silu_mul` -> cuBLAS down_proj (a split-K GEMM plus its reduction kernel) -> `add_rmsnorm`:
the activation is never written to memory, and the split-K reduction costs no kernel of its own.
`silu_down_partials` writes every (split, row, column) of its `[split_k, M, N]` output, zeros for an empty
K-range, so `add_rmsnorm_partials` sums all splits blindly, in a fixed order (no atomics: deterministic).
Numerics follow the kernels it replaces: the activation is rounded to the input dtype as
`fast_layers._silu_mul_kernel` rounds it, the summed GEMM output is rounded to it as cuBLAS's output is, then
the residual add and the norm round where `fast_layers._add_rmsnorm_kernel` does (`_rmsnorm_store` is that
kernel's tail; this module imports nothing from `fast_layers`, which sits above it).
Tiles and split counts (`DownConfig`) are timed against cuBLAS at engine start by `tune_down`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True)
class DownConfig:
    """Tiles of the fused SiLU + down GEMM: `block_m x block_n` outputs per program, `block_k` of the
    reduction per iteration, K cut into `split_k` ranges whose partial sums are added by the norm kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"DownConfig.{name}={value}: tl.dot needs a power of two >= 16")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: split_k, num_warps and num_stages must be >= 1")


# Qwen2.5-1.5B decode (N=1536, K=8960, M=64..256) on 132 SMs: tiles x split_k is about one wave (~120
# programs) at the row count each is meant for, and split_k divides K's 70 (block_k 128), 140 (64) or 280 (32)
# iterations evenly. Every program recomputes SiLU for its rows' K-range, so each activation is computed
# N / block_n times, two MUFU ops each (exp, reciprocal): wide block_n keeps that off the critical path
# (block_n 64 at M=256 is ~28 us of MUFU time alone), hence mostly 256 columns. Shared memory per stage is
# 2 * (2 * block_m + block_n) * block_k bytes (gate, up and weight tiles), kept <= 192 KiB in all.
DOWN_CANDIDATES: tuple[DownConfig, ...] = (
    DownConfig(64, 256, 64, 20, 8, 3),  # M=64: 6 x 20 programs
    DownConfig(64, 128, 128, 10, 4, 3),  # M=64: 12 x 10
    DownConfig(64, 64, 128, 5, 4, 4),  # M=64: 24 x 5
    DownConfig(64, 256, 64, 10, 8, 4),  # M=128: 2 x 6 x 10; M=64: 60
    DownConfig(64, 256, 64, 10, 4, 4),
    DownConfig(64, 128, 64, 5, 4, 4),  # M=128: 2 x 12 x 5
    DownConfig(128, 128, 64, 10, 8, 4),  # M=128: 12 x 10
    DownConfig(128, 256, 64, 10, 8, 3),  # M=256: 2 x 6 x 10
    DownConfig(64, 256, 64, 5, 8, 4),  # M=256: 4 x 6 x 5
    DownConfig(128, 128, 64, 5, 8, 4),  # M=256: 2 x 12 x 5
    DownConfig(64, 512, 32, 10, 8, 4),  # M=256: 4 x 3 x 10, SiLU computed 3 times only
)


@triton.jit
def _silu_act(gate, up):
    """silu(gate) rounded to up's dtype, times up: the arithmetic of `fast_layers._silu_mul_kernel`."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _rmsnorm_store(x, W, Out, row, stride_o, N, eps, cols, mask):
    """Out[row] = rmsnorm(x) * W, x a row in Out's dtype: the tail of `fast_layers._add_rmsnorm_kernel`."""
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_down_kernel(
    GU,
    W,
    P,
    M,
    N,
    K,
    iters_per_split,
    stride_gm,
    stride_wn,
    stride_ps,
    stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FUSE_SILU: tl.constexpr,
):
    """Program (tile, split) writes sum over its K-range of silu(gate) * up @ W.T for one output tile.
    The m-tile varies fastest, so the programs reading one weight tile run side by side (it comes from L2)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    first = split * iters_per_split
    num_iters = tl.minimum(iters_per_split, tl.cdiv(K, BLOCK_K) - first)  # <= 0: an empty range, zeros
    k0 = first * BLOCK_K
    # Rows and columns past the edge load row M-1's / column N-1's data (never stored): no mask on them,
    # so only K can need one, and none when it divides into blocks.
    gate_ptrs = GU + (rm % M)[:, None] * stride_gm + (k0 + rk)[None, :]  # up is K columns to the right
    w_ptrs = W + (rn % N)[None, :] * stride_wn + (k0 + rk)[:, None]  # [BLOCK_K, BLOCK_N] of W.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(num_iters):
        if EVEN_K:
            gate = tl.load(gate_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = k0 + i * BLOCK_K + rk < K
            gate = tl.load(gate_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if FUSE_SILU:
            if EVEN_K:
                up = tl.load(gate_ptrs + K)
            else:
                up = tl.load(gate_ptrs + K, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(_silu_act(gate, up), w, acc)
        else:  # GU holds the activation itself
            acc = tl.dot(gate, w, acc)
        gate_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = P + split * stride_ps + rm[:, None] * stride_pm + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _sum_add_rmsnorm_kernel(
    P,
    R,
    W,
    Out,
    ResOut,
    stride_ps,
    stride_pm,
    stride_r,
    stride_ro,
    stride_o,
    N,
    eps,
    NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(P + row * stride_pm + cols, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, NUM_SPLITS):  # unrolled, in split order: every run sums alike
        x += tl.load(P + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(Out.dtype.element_ty)  # where the replaced GEMM rounded its output
    x = x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(Out.dtype.element_ty)
    tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    _rmsnorm_store(x, W, Out, row, stride_o, N, eps, cols, mask)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + N + cols, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + cols, _silu_act(gate, up), mask=mask)


def silu_down_partials(
    gate_up_MK2: torch.Tensor,
    weight_NK: torch.Tensor,
    config: DownConfig,
    out: torch.Tensor | None = None,
    fuse_silu: bool = True,
) -> torch.Tensor:
    """fp32 `[split_k, M, N]`: split s holds its K-range's share of silu(gate) * up @ weight.T, where gate
    and up are the first and last K columns of `gate_up_MK2` (any row stride); with `fuse_silu=False` the
    input is the activation itself (`[M, K]`). `out` may be given (e.g. a buffer kept across CUDA-graph
    replays); every element of it is written."""
    num_rows, width = gate_up_MK2.shape
    n, k = weight_NK.shape
    assert width == (2 * k if fuse_silu else k), f"input has {width} columns for K={k}"
    assert gate_up_MK2.stride(1) == 1 and weight_NK.stride(1) == 1
    assert gate_up_MK2.dtype == weight_NK.dtype
    shape = (config.split_k, num_rows, n)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=gate_up_MK2.device)
    assert out.shape == shape and out.dtype == torch.float32 and out.stride(2) == 1
    iters = triton.cdiv(k, config.block_k)
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(n, config.block_n), config.split_k)
    _silu_down_kernel[grid](
        gate_up_MK2,
        weight_NK,
        out,
        num_rows,
        n,
        k,
        triton.cdiv(iters, config.split_k),
        gate_up_MK2.stride(0),
        weight_NK.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        FUSE_SILU=fuse_silu,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def add_rmsnorm_partials(
    partials_SMN: torch.Tensor, residual_MN: torch.Tensor, weight_N: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) with x = the sum of the partials, rounded to residual's
    dtype: `fast_layers.add_rmsnorm` of the GEMM output the partials stand for. One partial in the model
    dtype makes it exactly `add_rmsnorm(x, residual, ...)`."""
    num_splits, num_rows, dim = partials_SMN.shape
    assert residual_MN.shape == (num_rows, dim)
    assert partials_SMN.stride(2) == 1 and residual_MN.stride(1) == 1
    out = torch.empty(num_rows, dim, dtype=residual_MN.dtype, device=residual_MN.device)
    new_res = torch.empty_like(out)
    _sum_add_rmsnorm_kernel[(num_rows,)](
        partials_SMN,
        residual_MN,
        weight_N,
        out,
        new_res,
        partials_SMN.stride(0),
        partials_SMN.stride(1),
        residual_MN.stride(0),
        new_res.stride(0),
        out.stride(0),
        dim,
        eps,
        NUM_SPLITS=num_splits,
        BLOCK=triton.next_power_of_2(dim),
        num_warps=4,  # as `fast_layers.add_rmsnorm`: the same reduction tree, the same rounding
    )
    return out, new_res


def silu_down_add_rmsnorm(
    gate_up_MK2: torch.Tensor,
    weight_NK: torch.Tensor,
    residual_MN: torch.Tensor,
    norm_weight_N: torch.Tensor,
    eps: float,
    config: DownConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm(down_proj(silu_mul(gate_up)), residual, norm_weight, eps)` in two kernels."""
    partials = silu_down_partials(gate_up_MK2, weight_NK, config)
    return add_rmsnorm_partials(partials, residual_MN, norm_weight_N, eps)


def _cublas_tail(gate_up, weight, residual, norm_weight, eps):
    """The path being replaced, the same work kernel for kernel: fused SiLU * up, cuBLAS, add + RMSNorm."""
    num_rows, width = gate_up.shape
    act = torch.empty(num_rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(num_rows, triton.cdiv(width // 2, 1024))](
        gate_up, act, gate_up.stride(0), act.stride(0), width // 2, BLOCK=1024
    )
    return add_rmsnorm_partials(F.linear(act, weight)[None], residual, norm_weight, eps)


def tune_down(
    weight_NK: torch.Tensor,
    sizes: list[int],
    inter: int,
    eps: float = 1e-6,
    min_rows: int = 64,
    candidates: tuple[DownConfig, ...] = DOWN_CANDIDATES,
) -> tuple[dict[int, DownConfig | None], dict[int, dict[str, float]]]:
    """For each batch size, the candidate whose SiLU + down + add/RMSNorm beats the cuBLAS path by more
    than timing noise (5 %), or None to keep cuBLAS; also every timing (ms, "cublas" for the baseline; inf
    for a candidate this GPU cannot compile). Sizes under `min_rows` keep cuBLAS untimed: at a few rows the
    step is latency-bound and tuning them would only lengthen engine start. Reads `weight_NK` only."""
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    n, k = weight_NK.shape
    if k != inter:
        raise ValueError(f"down_proj weight is {tuple(weight_NK.shape)}: expected [hidden, {inter}]")
    device, dtype = weight_NK.device, weight_NK.dtype
    norm_weight = torch.ones(n, device=device, dtype=dtype)
    choices: dict[int, DownConfig | None] = {}
    timings: dict[int, dict[str, float]] = {}
    for rows in sizes:
        choices[rows] = None
        if rows < min_rows:
            continue
        gate_up = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
        residual = torch.randn(rows, n, device=device, dtype=dtype)
        args = (gate_up, weight_NK, residual, norm_weight, eps)
        ms = {"cublas": do_bench(lambda a=args: _cublas_tail(*a), warmup=5, rep=20)}
        for config in candidates:
            try:
                ms[str(config)] = do_bench(
                    lambda a=args, c=config: silu_down_add_rmsnorm(*a, c), warmup=5, rep=20
                )
            except OutOfResources:
                ms[str(config)] = float("inf")
        best = min(candidates, key=lambda c: ms[str(c)])
        if ms[str(best)] <= 0.95 * ms["cublas"]:  # `triton_attention._fastest`'s rule
            choices[rows] = best
        timings[rows] = ms
    return choices, timings
