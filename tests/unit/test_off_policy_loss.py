"""Off-policy corrections of the PPO loss against hand-computed values: TIS truncation and decoupled
PPO's dropped tokens (cap exactly hit, overflowing weights, ratios far from 1), gradients, masks, the
micro-batch layout of the behaviour logprobs, and the config keys that choose them."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.config.actor import AlgorithmConfig
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.trainer.batching import TrainSample, build_micro_batch, plan_rank_micro_batches
from tandemrl.trainer.loss import (
    PolicyLossConfig,
    importance_weights,
    loglinear_proximal,
    masked_sums,
    ppo_token_losses,
)

# weights pi_prox / pi_behav: below 1, 1, exactly the cap 2, above it, and one that overflows exp()
WEIGHTS = [0.5, 1.0, 2.0, 3.0]


def _weights(ws, correction, cap):
    behav = torch.tensor([-math.log(w) for w in ws] + [-1000.0], dtype=torch.float64)
    return importance_weights(torch.zeros_like(behav), behav, correction, cap)


def test_tis_truncates_at_the_cap():
    weight, capped = _weights(WEIGHTS, "tis", 2.0)
    assert weight.tolist() == pytest.approx([0.5, 1.0, 2.0, 2.0, 2.0])
    assert capped.tolist() == [False, False, False, True, True]  # exactly at the cap is not capped


def test_decoupled_drops_tokens_above_the_cap():
    weight, capped = _weights(WEIGHTS, "decoupled", 2.0)
    assert weight.tolist() == pytest.approx([0.5, 1.0, 2.0, 0.0, 0.0])
    assert capped.tolist() == [False, False, False, True, True]
    assert torch.isfinite(weight).all()


def test_weights_carry_no_gradient():
    prox = torch.tensor([0.0, -1.0], requires_grad=True)
    weight, _ = importance_weights(prox, torch.tensor([-0.5, -1.0]), "tis", 2.0)
    assert not weight.requires_grad


def test_unknown_correction_is_an_error():
    with pytest.raises(ValueError, match="unknown off-policy correction 'clip'"):
        importance_weights(torch.zeros(1), torch.zeros(1), "clip", 2.0)


def _ppo(ratios, advantages, ws, correction, cap=2.0, dual_clip_c=None):
    """logprobs at ratio r to the proximal policy (0), behaviour logprobs at weight w."""
    logprobs = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    prox = torch.zeros_like(logprobs)
    behav = torch.tensor([-math.log(w) for w in ws], dtype=torch.float64)
    cfg = PolicyLossConfig(0.2, 0.2, dual_clip_c, off_policy_correction=correction, is_weight_cap=cap)
    loss, stats = ppo_token_losses(
        logprobs, prox, torch.tensor(advantages, dtype=torch.float64), cfg, None, behav
    )
    return logprobs, loss, stats


@pytest.mark.parametrize(
    "correction, applied", [("tis", [0.5, 1.0, 2.0, 2.0]), ("decoupled", [0.5, 1.0, 2.0, 0.0])]
)
def test_loss_and_gradient_are_scaled_by_the_applied_weight(correction, applied):
    ratios, advantages = [1.1, 0.9, 1.0, 1.05], [1.0, -1.0, 2.0, 1.0]
    logprobs, loss, stats = _ppo(ratios, advantages, WEIGHTS, correction)
    # no ratio is clipped here, so the plain loss is -A r and its gradient -A r
    plain = [-a * r for r, a in zip(ratios, advantages, strict=True)]
    assert loss.tolist() == pytest.approx([p * w for p, w in zip(plain, applied, strict=True)])
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([p * w for p, w in zip(plain, applied, strict=True)])
    assert stats["is_weight"].tolist() == pytest.approx(applied)
    assert stats["is_clip_fraction"].tolist() == [0.0, 0.0, 0.0, 1.0]
    # the ratio statistics stay relative to the proximal policy
    assert stats["ratio_abs"].tolist() == pytest.approx([abs(r - 1) for r in ratios])


def test_ratio_far_from_one_is_clipped_then_weighted():
    # ratio 10 with A>0: clipped at 1.2; ratio 10 with A<0: dual clip caps at c|A| = 3; ratio 0.01, A<0: 0.8
    logprobs, loss, stats = _ppo(
        [10.0, 10.0, 0.01], [1.0, -1.0, -1.0], [1.5, 1.5, 4.0], "tis", dual_clip_c=3.0
    )
    assert loss.tolist() == pytest.approx([-1.2 * 1.5, 3.0 * 1.5, 0.8 * 2.0])
    assert stats["clip_fraction"].tolist() == [1.0, 1.0, 1.0]
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0])  # every token clipped: no gradient


def test_on_policy_data_makes_both_corrections_plain_ppo():
    """prox == behav (a synchronous step): every weight is 1 and the loss is PPO's."""
    ratios, advantages = [1.5, 0.5, 0.5, 1.0], [1.0, 1.0, -1.0, -1.0]
    _, plain, _ = _ppo(ratios, advantages, [1.0] * 4, "none")
    for correction in ("tis", "decoupled"):
        _, loss, stats = _ppo(ratios, advantages, [1.0] * 4, correction)
        assert loss.tolist() == pytest.approx(plain.tolist())
        assert stats["is_clip_fraction"].sum() == 0.0


def test_none_ignores_behaviour_logprobs_and_adds_no_statistics():
    _, with_behav, stats = _ppo([1.1, 0.9], [1.0, 1.0], [3.0, 0.1], "none")
    _, without, _ = _ppo([1.1, 0.9], [1.0, 1.0], [1.0, 1.0], "none")
    assert with_behav.tolist() == without.tolist()
    assert "is_weight" not in stats and "is_clip_fraction" not in stats


def test_correction_without_behaviour_logprobs_is_an_error():
    cfg = PolicyLossConfig(off_policy_correction="tis")
    with pytest.raises(ValueError, match="needs the rollout's behav_logprobs"):
        ppo_token_losses(torch.zeros(2), torch.zeros(2), torch.ones(2), cfg)


def test_masked_and_all_masked_tokens_add_nothing():
    _, loss, stats = _ppo([1.1, 0.9, 1.0], [1.0, 1.0, 1.0], [3.0, 0.5, 1.0], "tis")
    sums = masked_sums({"loss": loss, **stats}, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    assert sums["is_weight"] == pytest.approx(1.5) and sums["is_clip_fraction"] == 0.0
    none = masked_sums({"loss": loss, **stats}, torch.zeros(3, dtype=torch.float64))
    assert none == {name: 0.0 for name in none}


def test_micro_batch_keeps_behaviour_logprobs_in_the_next_token_layout():
    plain = TrainSample([5, 6, 7], [0, 1, 1], [0.0, -1.0, -2.0], 1.0)
    recomputed = TrainSample([5, 6, 7, 8], [0, 1, 0, 1], [0.0, -1.5, 0.0, -2.5], 1.0, [0.0, -1.0, 0.0, -3.0])
    micro = build_micro_batch([plain, recomputed], [0, 1])
    # plain: behav = old; recomputed: its own behaviour logprobs, shifted like old_logprobs
    assert micro.behav_logprobs_N.tolist() == [-1.0, -2.0, 0.0, -1.0, 0.0, -3.0, 0.0]
    assert micro.old_logprobs_N.tolist() == [-1.0, -2.0, 0.0, -1.5, 0.0, -2.5, 0.0]
    # an all-masked padding micro-batch (rank with nothing to do) carries zeros
    pad = plan_rank_micro_batches([plain], rank=1, num_ranks=2, max_tokens=64)
    assert pad[0].mask_N.sum() == 0 and pad[0].behav_logprobs_N.abs().sum() == 0


def test_misaligned_behaviour_logprobs_are_an_error():
    with pytest.raises(ValueError, match="behav_logprobs 2"):
        TrainSample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, [0.0, -1.0])


def test_loss_config_takes_the_cap_of_its_correction():
    tis = PolicyLossConfig.from_algorithm(AlgorithmConfig(off_policy_correction="tis", tis_cap=3.0))
    assert (tis.off_policy_correction, tis.is_weight_cap) == ("tis", 3.0)
    dec = PolicyLossConfig.from_algorithm(
        AlgorithmConfig(off_policy_correction="decoupled", decoupled_weight_cap=4.0)
    )
    assert (dec.off_policy_correction, dec.is_weight_cap) == ("decoupled", 4.0)


@pytest.mark.parametrize("correction, recompute", [("none", False), ("tis", True), ("decoupled", True)])
def test_recompute_is_derived_from_the_correction(correction, recompute):
    config = load_config(None, [f"algorithm.off_policy_correction={correction}", "runner.output_dir=/tmp/x"])
    assert config.algorithm.recompute_logprobs is recompute
    assert "algorithm.recompute_logprobs" in config.derived


def test_explicit_recompute_is_kept():
    config = load_config(None, ["algorithm.recompute_logprobs=true", "runner.output_dir=/tmp/x"])
    assert config.algorithm.recompute_logprobs is True
    assert "algorithm.recompute_logprobs" not in config.derived


def test_correction_without_recompute_names_both_keys():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.off_policy_correction=decoupled", "algorithm.recompute_logprobs=false"])
    message = str(info.value)
    assert "algorithm.recompute_logprobs=False" in message
    assert "algorithm.off_policy_correction='decoupled'" in message


@pytest.mark.parametrize(
    "override, match",
    [
        ("algorithm.off_policy_correction=truncated", "must be one of none, decoupled, tis"),
        ("algorithm.tis_cap=0.5", r"algorithm.tis_cap=0.5: must be >= 1"),
        ("algorithm.decoupled_weight_cap=0", r"algorithm.decoupled_weight_cap=0.0: must be >= 1"),
    ],
)
def test_bad_correction_keys_are_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_clipped_positive_advantage_counts_only_positive_tokens_above_the_clip():
    """pos_advantage sums A+ over tokens; clipped_pos_advantage only where the clip cut a positive push
    (ratio above 1 + eps): a risen token with A>0 and nothing from A<0 tokens, clipped or not."""
    # ratio 1.5, A=2: clipped (counts 2); ratio 1.1, A=3: inside the clip; ratio 0.5, A=-1: clipped, A<0
    _, _, stats = _ppo([1.5, 1.1, 0.5], [2.0, 3.0, -1.0], [1.0, 1.0, 1.0], "none")
    assert stats["pos_advantage"].tolist() == pytest.approx([2.0, 3.0, 0.0])
    assert stats["clipped_pos_advantage"].tolist() == pytest.approx([2.0, 0.0, 0.0])
    assert stats["clip_fraction"].tolist() == [1.0, 0.0, 1.0]


def test_current_proximal_needs_a_correction_and_skips_the_recompute():
    with pytest.raises(ConfigError, match="algorithm.proximal_logprobs"):
        load_config(None, ["algorithm.proximal_logprobs=current", "runner.output_dir=/tmp/x"])
    config = load_config(
        None,
        [
            "algorithm.off_policy_correction=tis",
            "algorithm.proximal_logprobs=current",
            "runner.output_dir=/tmp/x",
        ],
    )
    assert config.algorithm.recompute_logprobs is False
    assert "proximal_logprobs=current" in config.derived["algorithm.recompute_logprobs"]
    explicit = load_config(
        None,
        [
            "algorithm.off_policy_correction=decoupled",
            "algorithm.proximal_logprobs=current",
            "algorithm.recompute_logprobs=false",
            "runner.output_dir=/tmp/x",
        ],
    )
    assert explicit.algorithm.recompute_logprobs is False
    with pytest.raises(ConfigError, match="must be one of recompute, current"):
        load_config(None, ["algorithm.proximal_logprobs=later", "runner.output_dir=/tmp/x"])


@pytest.mark.parametrize(
    "async_mode, correction, recompute", [(True, "decoupled", True), (False, "none", False)]
)
def test_unset_correction_is_derived_from_the_mode(async_mode, correction, recompute):
    mode = [f"runner.async_mode={str(async_mode).lower()}", "agentloop.task_name=searchr1"]
    config = load_config(None, [*mode, "runner.output_dir=/tmp/x"])
    assert config.algorithm.off_policy_correction == correction
    assert config.derived["algorithm.off_policy_correction"].startswith(correction)
    assert config.algorithm.recompute_logprobs is recompute
    # a value the user sets is kept in either mode, and not reported as derived
    explicit = load_config(
        None,
        [*mode, "algorithm.off_policy_correction=tis", "runner.output_dir=/x"],
    )
    assert explicit.algorithm.off_policy_correction == "tis"
    assert "algorithm.off_policy_correction" not in explicit.derived
    # async with the rollout's logprobs kept as the old ones (RLinf's recipe): no correction is derived
    kept = load_config(None, [*mode, "algorithm.recompute_logprobs=false", "runner.output_dir=/x"])
    assert kept.algorithm.off_policy_correction == "none"


def test_current_proximal_in_sync_is_refused_once_the_correction_is_derived():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.proximal_logprobs=current", "runner.output_dir=/tmp/x"])
    assert "algorithm.proximal_logprobs" in str(err.value) and "needs an off-policy correction" in str(
        err.value
    )


def test_a_hand_built_algorithm_section_must_name_its_correction():
    with pytest.raises(ValueError, match="algorithm.off_policy_correction is unset"):
        PolicyLossConfig.from_algorithm(AlgorithmConfig())


def test_loglinear_proximal_interpolates_by_lag_without_gradient():
    behav = torch.tensor([-1.0, -1.0, -1.0, -2.0])
    current = torch.tensor([-0.4, -0.4, -0.4, -2.0], requires_grad=True)
    prox = loglinear_proximal(behav, current, torch.tensor([0.0, 1.0, 2.0, 3.0]))
    # lag 0: the rollout's; lag 1: halfway; lag 2: two thirds of the way; equal logprobs stay put
    assert prox.tolist() == pytest.approx([-1.0, -0.7, -0.6, -2.0])
    assert not prox.requires_grad


def test_loglinear_proximal_needs_a_correction_and_skips_the_recompute():
    with pytest.raises(ConfigError, match="needs an off-policy correction"):
        load_config(None, ["algorithm.proximal_logprobs=loglinear", "runner.output_dir=/tmp/x"])
    config = load_config(
        None,
        [
            "runner.async_mode=true",
            "agentloop.task_name=searchr1",
            "algorithm.proximal_logprobs=loglinear",
            "runner.output_dir=/tmp/x",
        ],
    )
    assert config.algorithm.off_policy_correction == "decoupled"  # derived in async
    assert config.algorithm.recompute_logprobs is False
    assert "proximal_logprobs=loglinear" in config.derived["algorithm.recompute_logprobs"]
