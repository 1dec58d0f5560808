"""trainer/low_precision.py on CPU: stochastic rounding (unbiased, within one bf16 ulp), why it is needed (tiny
updates accumulate where round-to-nearest drops them), and its AdamW against torch's, its state dict
round trip included."""

from __future__ import annotations

import copy

import pytest
import torch

from tandemrl.config.actor import OptimConfig
from tandemrl.trainer.low_precision import LowPrecisionAdamW, cast_parameters, stochastic_round
from tandemrl.trainer.optim import build_optimizer


def _bf16_neighbours(num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lower, upper, x): adjacent bf16 values of mixed signs and magnitudes, and an fp32 value strictly
    between each pair."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.empty(num).uniform_(-12, 4, generator=gen))
    sign = torch.where(torch.rand(num, generator=gen) < 0.5, -1.0, 1.0)
    lower = (sign * magnitude).to(torch.bfloat16).float()
    upper = torch.nextafter(
        lower.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)
    ).float()
    frac = torch.empty(num).uniform_(0.05, 0.95, generator=gen)
    x = lower + frac * (upper - lower)
    assert bool(((x > lower) & (x < upper)).all()), "each x lies strictly between its neighbours"
    return lower, upper, x


def test_stochastic_rounding_is_unbiased_and_within_one_ulp():
    """Every rounding lands on one of the two bf16 neighbours; over many roundings their mean is x: the
    share rounded up matches (x - lower) / (upper - lower) within 4 standard errors of a binomial."""
    torch.manual_seed(0)
    lower, upper, x = _bf16_neighbours(64)
    num_draws = 4000
    rounded = torch.stack([stochastic_round(x) for _ in range(num_draws)]).float()  # [draws, 64]
    assert bool(((rounded == lower) | (rounded == upper)).all())
    p_up = (x - lower) / (upper - lower)
    share_up = (rounded == upper).double().mean(0)
    standard_error = torch.sqrt(p_up * (1 - p_up) / num_draws)
    assert bool(((share_up - p_up).abs() <= 4 * standard_error).all()), (share_up - p_up).abs().max()
    bias = ((rounded.mean(0) - x) / (upper - lower)).abs().max().item()
    assert bias < 0.05, bias  # in ulps; 4 standard errors of the worst case p = 0.5 is 0.032


def test_stochastic_rounding_keeps_exact_values_and_infinities():
    exact = torch.tensor([0.0, -0.0, 1.0, -3.5, 2.0**-100, float("inf"), float("-inf")])
    for _ in range(20):
        rounded = stochastic_round(exact)
        assert torch.equal(rounded.float(), exact)


def test_tiny_updates_accumulate_with_stochastic_rounding_and_vanish_with_round_to_nearest():
    """1000 steps of +1e-6 on bf16 weights near 0.02 (half an ulp there is 3.8e-5): round-to-nearest never
    moves them; stochastic rounding moves them by 1000 x 1e-6 on average."""
    torch.manual_seed(0)
    start = torch.full((4096,), 0.02).to(torch.bfloat16)
    nearest, stochastic = start.clone(), start.clone()
    step, num_steps = 1e-6, 1000
    for _ in range(num_steps):
        nearest = (nearest.float() + step).to(torch.bfloat16)
        stochastic = stochastic_round(stochastic.float() + step)
    assert torch.equal(nearest, start)
    moved = (stochastic.float() - start.float()).mean().item()
    # the mean of 4096 weights: its standard error is under 2 ulps / sqrt(4096) ~ 4e-6, against 1e-3
    assert abs(moved - num_steps * step) < 0.05 * num_steps * step, moved


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_steps: int, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    dtype = next(model.parameters()).dtype
    for _ in range(num_steps):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fp32_update_is_torch_adamw():
    """With fp32 parameters and moments the update is torch.optim.AdamW's, to fp32 rounding."""
    ours, theirs = _model(), _model()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    _train(ours, LowPrecisionAdamW(ours.parameters(), **kwargs), 20)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), **kwargs, foreach=True), 20)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bf16_parameters_train_like_fp32(state_dtype):
    """bf16 parameters (and bf16 moments) follow the fp32 run's loss; the dtypes are as configured."""
    optim = OptimConfig(lr=1e-2, state_dtype=state_dtype)
    reference = _model()
    losses32 = _train(reference, build_optimizer(reference.parameters(), OptimConfig(lr=1e-2), 100)[0], 30)
    model = cast_parameters(_model(), torch.bfloat16)
    optimizer, _ = build_optimizer(model.parameters(), optim, 100)
    assert isinstance(optimizer, LowPrecisionAdamW)
    losses16 = _train(model, optimizer, 30)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == getattr(torch, state_dtype)
    assert losses32[-1] < 0.5 * losses32[0], "the fp32 run must learn for the comparison to mean anything"
    assert losses16[-1] < 0.5 * losses16[0]
    worst = max(abs(a - b) / a for a, b in zip(losses32, losses16, strict=True))
    print(f"worst relative loss gap, bf16 parameters ({state_dtype} moments) vs fp32: {worst:.4f}")
    assert worst < 0.1, worst  # observed 0.032 (fp32 moments) and 0.023 (bf16 moments); a lost update: ~1


def test_fp32_state_builds_torch_adamw():
    """The default (fp32 parameters, fp32 moments) keeps torch.optim.AdamW, bit for bit as before."""
    optimizer, _ = build_optimizer(_model().parameters(), OptimConfig(), 10)
    assert type(optimizer) is torch.optim.AdamW
    optimizer, _ = build_optimizer(_model().parameters(), OptimConfig(state_dtype="bfloat16"), 10)
    assert isinstance(optimizer, LowPrecisionAdamW) and optimizer.state_dtype == torch.bfloat16


def test_state_dict_round_trip_keeps_fp32_moments_of_bf16_parameters():
    """torch's load casts state to the parameter's dtype; ours keeps the fp32 moments exact, and the next
    steps of the restored optimizer (same RNG) are those of the original."""
    model = cast_parameters(_model(), torch.bfloat16)
    optimizer = LowPrecisionAdamW(model.parameters(), lr=1e-3)
    _train(model, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    restored = LowPrecisionAdamW(twin.parameters(), lr=1e-3)
    restored.load_state_dict(saved)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert restored.state[q][key].dtype == torch.float32
            assert torch.equal(restored.state[q][key], optimizer.state[p][key])
        assert torch.equal(restored.state[q]["step"], optimizer.state[p]["step"])
    torch.manual_seed(5)
    _train(model, optimizer, 2, seed=7)
    torch.manual_seed(5)
    _train(twin, restored, 2, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_cast_parameters_keeps_ties_and_buffers():
    module = torch.nn.Module()
    module.a = torch.nn.Linear(4, 4)
    module.b = torch.nn.Linear(4, 4)
    module.b.weight = module.a.weight
    module.register_buffer("inv_freq", torch.rand(3))
    cast_parameters(module, torch.bfloat16)
    assert module.a.weight is module.b.weight and module.a.weight.dtype == torch.bfloat16
    assert module.inv_freq.dtype == torch.float32
