"""GRPO advantages against hand-computed values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tandemrl.trainer.advantages import STD_EPS, compute_grpo_advantages, samples_from_trajectories


def test_mean_and_std_normalisation_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    (adv,) = compute_grpo_advantages([[1.0, 0.0, 0.0, 1.0]], norm_by_std=True)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + STD_EPS)
    assert adv == pytest.approx([a, -a, -a, a], abs=1e-9)
    assert adv[0] == pytest.approx(0.866025, abs=1e-5)


def test_mean_only_without_std():
    assert compute_grpo_advantages([[3.0, 1.0, 2.0]], norm_by_std=False) == [[1.0, -1.0, 0.0]]


def test_equal_rewards_give_exactly_zero():
    out = compute_grpo_advantages([[1.0, 1.0, 1.0], [0.0, 0.0], [0.3]], norm_by_std=True)
    assert out == [[0.0, 0.0, 0.0], [0.0, 0.0], [0.0]]
    assert compute_grpo_advantages([[0.7, 0.7]], norm_by_std=False) == [[0.0, 0.0]]


def test_groups_are_independent():
    out = compute_grpo_advantages([[1.0, 0.0], [5.0, 5.0], [2.0, 4.0]], norm_by_std=False)
    assert out == [[0.5, -0.5], [0.0, 0.0], [-1.0, 1.0]]


def test_empty_group_is_an_error():
    with pytest.raises(ValueError, match="empty group"):
        compute_grpo_advantages([[]], norm_by_std=True)


@dataclass
class FakeTrajectory:
    """Stands in for the agent's Trajectory (only the fields the trainer reads)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    weight_versions: list[int] | None = None


def test_samples_from_trajectories_aligns_prompt_and_response():
    group = [
        FakeTrajectory([1, 2], [3, 4, 5], [1, 0, 1], [-0.5, 0.0, -0.25], 1.0),
        FakeTrajectory([1, 2], [6], [1], [-2.0], 0.0),
    ]
    a, b = samples_from_trajectories([group], norm_by_std=False)
    assert a.input_ids == [1, 2, 3, 4, 5] and a.loss_mask == [0, 0, 1, 0, 1]
    assert a.old_logprobs == [0.0, 0.0, -0.5, 0.0, -0.25]
    assert (a.advantage, b.advantage) == (0.5, -0.5)
    assert b.num_loss_tokens == 1


def test_samples_from_trajectories_rejects_misaligned_lists():
    bad = FakeTrajectory([1], [3, 4], [1], [-0.5, -0.5], 1.0)
    with pytest.raises(ValueError, match="same length"):
        samples_from_trajectories([[bad]], norm_by_std=True)


def test_token_lags_count_versions_behind_the_actor_and_only_for_sampled_tokens():
    group = [
        FakeTrajectory([1, 2], [3, 4, 5, 6], [1, 0, 1, 1], [-0.5, 0.0, -0.25, -0.1], 1.0, [7, -1, 8, 9]),
        FakeTrajectory([1, 2], [6], [1], [-2.0], 0.0, [9]),
    ]
    a, b = samples_from_trajectories([group], norm_by_std=False, actor_version=9)
    assert a.lags == [0, 0, 2, 0, 1, 0]  # prompt and the tool token 0; sampled at 7, 8 and 9
    assert b.lags == [0, 0, 0]
    # without the actor's version (every correction but loglinear) nothing is counted
    assert samples_from_trajectories([group], norm_by_std=False)[0].lags is None
    bad = FakeTrajectory([1], [3, 4], [1, 1], [-0.5, -0.5], 1.0, [3])
    with pytest.raises(ValueError, match="weight_versions has 1 entries for 2 response tokens"):
        samples_from_trajectories([[bad, bad]], norm_by_std=True, actor_version=4)
