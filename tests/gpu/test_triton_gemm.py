"""The fused decode MLP tail of `triton_gemm` (SiLU * up + split-K down_proj, then sum + add + RMSNorm) against
`fast_layers`' kernels and cuBLAS: every tile candidate, batch sizes 1 to 256, K that splits unevenly, a
strided gate_up. The same checks ran on CPU under TRITON_INTERPRET=1 in fp16 (the interpreter miscomputes
bf16): partial sums within 1.1e-6 of an fp64 reference, new residual and normed output bit-exact."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HIDDEN, INTER = 1536, 8960  # Qwen2.5-1.5B's down_proj
NUM_CANDIDATES = 11


def _case(num_rows: int, n: int, k: int, seed: int, row_pad: int = 0):
    """Random bf16 gate_up `[M, 2k]` (row stride 2k + row_pad), down weight `[n, k]`, residual, norm weight."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    gate_up = randn(num_rows, 2 * k + row_pad)[:, : 2 * k]
    weight = (randn(n, k).float() * 0.02).to(torch.bfloat16)
    norm_weight = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    return gate_up, weight, randn(num_rows, n), norm_weight


def _sequential_sum(partials_SMN: torch.Tensor) -> torch.Tensor:
    total = partials_SMN[0].clone()
    for part in partials_SMN[1:]:  # split order, as the kernel adds them
        total += part
    return total


def _within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)  # 2^-7 |x| >= 1 ulp
    diff = (actual.float() - expected.float()).abs()
    assert (diff <= ulp).all(), f"{(diff > ulp).sum().item()} elements off by more than 1 bf16 ulp"


@pytest.mark.parametrize("num_rows", [1, 7, 64, 256])
@pytest.mark.parametrize("n,k", [(HIDDEN, INTER), (320, 1000)])  # 1000: no multiple of block_k x split_k
@pytest.mark.parametrize("index", range(NUM_CANDIDATES))
def test_silu_down_matches_silu_mul_then_linear(index, n, k, num_rows):
    from tandemrl.engine.fast_layers import add_rmsnorm, silu_mul
    from tandemrl.engine.triton_gemm import DOWN_CANDIDATES, add_rmsnorm_partials, silu_down_partials

    assert len(DOWN_CANDIDATES) == NUM_CANDIDATES, "parametrize index over every candidate"
    config = DOWN_CANDIDATES[index]
    gate_up, weight, residual, norm_weight = _case(num_rows, n, k, seed=index)
    out = torch.full((config.split_k, num_rows, n), float("nan"), device="cuda")
    partials = silu_down_partials(gate_up, weight, config, out=out)
    assert not partials.isnan().any(), "a (split, row, column) of the partial sums was not written"
    act = silu_mul(gate_up)
    # Same bf16 products, fp32 sums in another order: far tighter than an activation rounded elsewhere.
    reference = torch.nn.functional.linear(act.float(), weight.float())
    torch.testing.assert_close(partials.sum(0), reference, atol=1e-3, rtol=1e-3)
    cublas = torch.nn.functional.linear(act, weight).float()
    torch.testing.assert_close(partials.sum(0), cublas, atol=2e-2, rtol=2e-2)

    normed, new_residual = add_rmsnorm_partials(partials, residual, norm_weight, 1e-6)
    ref_normed, ref_residual = add_rmsnorm(
        _sequential_sum(partials).to(torch.bfloat16), residual, norm_weight, 1e-6
    )
    assert torch.equal(new_residual, ref_residual)
    _within_one_ulp(normed, ref_normed)


@pytest.mark.parametrize("index", range(NUM_CANDIDATES))
def test_strided_gate_up_gives_the_same_partials(index):
    from tandemrl.engine.triton_gemm import DOWN_CANDIDATES, silu_down_partials

    config = DOWN_CANDIDATES[index]
    strided, weight, _, _ = _case(96, HIDDEN, INTER, seed=7, row_pad=40)
    assert strided.stride(0) == 2 * INTER + 40
    torch.testing.assert_close(
        silu_down_partials(strided, weight, config),
        silu_down_partials(strided.contiguous(), weight, config),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize("num_splits", [1, 3, 20])
@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_add_rmsnorm_partials_equals_sum_then_add_rmsnorm(num_splits, num_rows):
    from tandemrl.engine.fast_layers import add_rmsnorm
    from tandemrl.engine.triton_gemm import add_rmsnorm_partials

    gen = torch.Generator(device="cuda").manual_seed(num_splits * 1000 + num_rows)
    partials = torch.randn(num_splits, num_rows, HIDDEN, device="cuda", generator=gen)
    _, _, residual, norm_weight = _case(num_rows, HIDDEN, 16, seed=3)
    normed, new_residual = add_rmsnorm_partials(partials, residual, norm_weight, 1e-6)
    ref_normed, ref_residual = add_rmsnorm(
        _sequential_sum(partials).to(torch.bfloat16), residual, norm_weight, 1e-6
    )
    assert torch.equal(new_residual, ref_residual)
    _within_one_ulp(normed, ref_normed)
    # one partial in bf16 is the plain add + RMSNorm (the tuner's baseline relies on it)
    x = partials[0].to(torch.bfloat16)
    plain, plain_res = add_rmsnorm(x, residual, norm_weight, 1e-6)
    fused, fused_res = add_rmsnorm_partials(x[None], residual, norm_weight, 1e-6)
    assert torch.equal(fused_res, plain_res)
    _within_one_ulp(fused, plain)


def test_tune_down_keeps_cublas_below_min_rows_and_times_every_candidate():
    from tandemrl.engine.triton_gemm import DOWN_CANDIDATES, tune_down

    _, weight, _, _ = _case(1, HIDDEN, INTER, seed=5)
    choices, timings = tune_down(weight, [8, 64], INTER)
    assert choices[8] is None and 8 not in timings
    assert choices[64] is None or choices[64] in DOWN_CANDIDATES
    assert set(timings[64]) == {"cublas", *map(str, DOWN_CANDIDATES)}
    if choices[64] is not None:
        assert timings[64][str(choices[64])] <= 0.95 * timings[64]["cublas"]
    with pytest.raises(ValueError, match="expected"):
        tune_down(weight, [64], INTER + 1)
