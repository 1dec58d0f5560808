"""GRPO advantages: each trajectory's reward normalised within its group (one prompt's trajectories).

Invariant: a group whose rewards are all equal yields advantage exactly 0 for every trajectory (it
carries no learning signal), whether or not the std normalisation is on. The advantage is a scalar per
trajectory; the loss applies it to every model-sampled token of that trajectory (`TrainSample.loss_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tandemrl.trainer.batching import TrainSample

STD_EPS = 1e-6


def compute_grpo_advantages(rewards: list[list[float]], norm_by_std: bool) -> list[list[float]]:
    """Per group: (r - mean) / (std + eps) when `norm_by_std`, else r - mean.

    std is the unbiased sample std (as torch.std, verl and TRL use); a group of one trajectory has
    advantage 0, since there is nothing to compare it with.
    """
    advantages = []
    for group in rewards:
        if not group:
            raise ValueError("compute_grpo_advantages got an empty group; every group needs >= 1 reward.")
        mean = sum(group) / len(group)
        if len(group) == 1 or all(r == group[0] for r in group):
            advantages.append([0.0] * len(group))
            continue
        centred = [r - mean for r in group]
        if norm_by_std:
            std = math.sqrt(sum(c * c for c in centred) / (len(group) - 1))
            centred = [c / (std + STD_EPS) for c in centred]
        advantages.append(centred)
    return advantages


def samples_from_trajectories(
    groups: Sequence[Sequence[Any]], norm_by_std: bool, actor_version: int | None = None
) -> list[TrainSample]:
    """Turn groups of agent `Trajectory`s into `TrainSample`s with their GRPO advantage.

    A trajectory needs `prompt_ids`, `response_ids`, `loss_mask`, `rollout_logprobs` (response-aligned)
    and `reward`; the prompt part gets mask 0 and old logprob 0. With `actor_version` (the actor's weight
    version at the step's start) and the trajectory's `weight_versions` (response-aligned, -1 where unknown),
    each sampled token's `lags` is how many versions it is behind (`TrainSample.lags`).
    """
    advantages = compute_grpo_advantages([[t.reward for t in group] for group in groups], norm_by_std)
    samples = []
    for group, group_advantages in zip(groups, advantages, strict=True):
        for trajectory, advantage in zip(group, group_advantages, strict=True):
            num_prompt = len(trajectory.prompt_ids)
            if not (
                len(trajectory.response_ids) == len(trajectory.loss_mask) == len(trajectory.rollout_logprobs)
            ):
                raise ValueError(
                    f"trajectory {getattr(trajectory, 'prompt_id', '?')}: response_ids, loss_mask and "
                    "rollout_logprobs must have the same length; the agent loop must record one entry per "
                    "response token."
                )
            samples.append(
                TrainSample(
                    input_ids=list(trajectory.prompt_ids) + list(trajectory.response_ids),
                    loss_mask=[0] * num_prompt + [int(m) for m in trajectory.loss_mask],
                    old_logprobs=[0.0] * num_prompt + [float(x) for x in trajectory.rollout_logprobs],
                    advantage=float(advantage),
                    lags=token_lags(trajectory, num_prompt, actor_version),
                )
            )
    return samples


def token_lags(trajectory: Any, num_prompt: int, actor_version: int | None) -> list[int] | None:
    """Per token (prompt included), how many weight versions behind `actor_version` the token was sampled:
    0 on the prompt, on tool output and where the version is unknown. None without `actor_version` or
    without recorded versions."""
    versions = getattr(trajectory, "weight_versions", None)
    if actor_version is None or not versions:
        return None
    if len(versions) != len(trajectory.response_ids):
        raise ValueError(
            f"trajectory {getattr(trajectory, 'prompt_id', '?')}: weight_versions has {len(versions)} entries "
            f"for {len(trajectory.response_ids)} response tokens; the agent loop must record one per token."
        )
    return [0] * num_prompt + [max(actor_version - int(v), 0) if v >= 0 else 0 for v in versions]
