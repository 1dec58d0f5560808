"""PPO loss against hand-computed values: both clip sides, dual clip, masks, ragged token-mean, KL."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.trainer.loss import PolicyLossConfig, low_var_kl, masked_sums, ppo_token_losses


def _losses(ratios, advantages, cfg=None, ref=None):
    logprobs = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logprobs)
    loss, stats = ppo_token_losses(
        logprobs, old, torch.tensor(advantages, dtype=torch.float64), cfg or PolicyLossConfig(0.2, 0.2), ref
    )
    return logprobs, loss, stats


def test_clip_both_sides_by_hand():
    # A>0: ratio 1.5 clipped to 1.2 -> -1.2; ratio 0.5 not clipped (pessimistic) -> -0.5
    # A<0: ratio 0.5 clipped to 0.8 -> 0.8; ratio 1.5 not clipped -> 1.5; ratio 1.0 -> 1.0
    _, loss, stats = _losses([1.5, 0.5, 0.5, 1.5, 1.0], [1.0, 1.0, -1.0, -1.0, -1.0])
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.5, 1.0])
    assert stats["clip_fraction"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert stats["ratio_abs"].tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.0])


def test_clipped_tokens_have_no_gradient():
    logprobs, loss, _ = _losses([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss.sum().backward()
    # d(-A r)/d logp = -A r for unclipped tokens, 0 for clipped ones
    assert logprobs.grad.tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5])


def test_asymmetric_clip():
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    _, loss, stats = _losses([1.5, 1.25, 0.5], [1.0, 1.0, -1.0], cfg)
    assert loss.tolist() == pytest.approx([-1.28, -1.25, 0.8])
    assert stats["clip_fraction"].tolist() == [1.0, 0.0, 1.0]


def test_dual_clip_caps_negative_advantages():
    cfg = PolicyLossConfig(0.2, 0.2, dual_clip_c=3.0)
    # A=-2, ratio 5: plain PPO loss 10, capped at c|A| = 6; A=-2, ratio 2: 4 < 6 stays; A=+1 ratio 5: -1.2
    logprobs, loss, stats = _losses([5.0, 2.0, 5.0], [-2.0, -2.0, 1.0], cfg)
    assert loss.tolist() == pytest.approx([6.0, 4.0, -1.2])
    assert stats["clip_fraction"].tolist() == [1.0, 0.0, 1.0]
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 4.0, 0.0])


def test_approx_kl_is_k3():
    _, _, stats = _losses([2.0, 1.0], [1.0, 1.0])
    assert stats["approx_kl"].tolist() == pytest.approx([2.0 - 1.0 - math.log(2.0), 0.0])


def test_masks_exclude_tokens_from_sums():
    _, loss, stats = _losses([1.5, 0.5, 0.9], [1.0, 1.0, 1.0])
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    sums = masked_sums({"loss": loss, **stats}, mask)
    assert sums["loss"] == pytest.approx(-1.2 - 0.9)
    assert sums["clip_fraction"] == 1.0


def test_token_mean_over_ragged_lengths():
    """Token-mean over all tokens of the minibatch, not mean of per-sequence means."""
    cfg = PolicyLossConfig(0.2, 0.2)
    seq_a = ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])  # 3 tokens, loss -2 each
    seq_b = ([1.0], [-1.0])  # 1 token, loss 1
    total, tokens = 0.0, 0
    for ratios, adv in (seq_a, seq_b):
        logprobs = torch.log(torch.tensor(ratios))
        loss, _ = ppo_token_losses(logprobs, torch.zeros_like(logprobs), torch.tensor(adv), cfg)
        total += float(masked_sums({"loss": loss}, torch.ones_like(loss))["loss"])
        tokens += len(ratios)
    assert total / tokens == pytest.approx((-2.0 * 3 + 1.0) / 4)  # -1.25; sequence-mean would be -0.5


def test_low_var_kl_to_reference():
    logprobs = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.0, -1.0])
    assert low_var_kl(logprobs, ref).tolist() == pytest.approx([0.0, math.e - 1.0 - 1.0])
    cfg = PolicyLossConfig(0.2, 0.2, kl_coef=0.5)
    loss, stats = ppo_token_losses(logprobs, logprobs.clone(), torch.zeros(2), cfg, ref)
    assert loss.tolist() == pytest.approx([0.0, 0.5 * (math.e - 2.0)])
    assert "kl_ref" in stats


def test_config_from_algorithm_defaults_high_to_low():
    from tandemrl.config.actor import AlgorithmConfig

    cfg = PolicyLossConfig.from_algorithm(
        AlgorithmConfig(ratio_clip_eps=0.1, dual_clip_c=2.0, off_policy_correction="none")
    )
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c) == (0.1, 0.1, 2.0)
    cfg = PolicyLossConfig.from_algorithm(
        AlgorithmConfig(ratio_clip_eps_high=0.3, off_policy_correction="none")
    )
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.2, 0.3)
