"""The step's rollout metrics per data source (runner/step_metrics.py): reward, searches, groups without a
learning signal, and the push of the GRPO advantages on the number of searches, from constructed groups
of real agent trajectories."""

from __future__ import annotations

import math

import pytest

from tandemrl.agent.loop import Trajectory
from tandemrl.buffer.group import Group
from tandemrl.buffer.rollout_buffer import HandOff
from tandemrl.data.loader import Prompt
from tandemrl.runner.step_metrics import rollout_metrics


def group(issue_id: int, source: str, rewards: list[float], searches: list[int]) -> Group:
    prompt = Prompt(f"train:{issue_id}", "q?", ["a"], source)
    trajectories = [
        Trajectory(
            prompt_ids=[1, 2],
            response_ids=[3] * (5 + 3 * n),
            loss_mask=[1] * (5 + 3 * n),
            rollout_logprobs=[-0.5] * (5 + 3 * n),
            weight_versions=[0] * (5 + 3 * n),
            searches=[f"query {k}" for k in range(n)],
            reward=r,
            data_source=source,
        )
        for r, n in zip(rewards, searches, strict=True)
    ]
    g = Group(issue_id, prompt, "searchr1", issued_weight_version=0, issued_at_s=0.0)
    g.finish(trajectories, weight_version=0, now_s=1.0)
    return g


def test_per_source_reward_searches_equal_groups_and_search_advantage():
    groups = [
        group(0, "kb_2hop", [1.0, 0.0], [2, 1]),  # the second search is what was right
        group(1, "kb_2hop", [0.0, 0.0], [1, 1]),  # no signal
        group(2, "kb_1hop", [1.0, 0.0], [1, 2]),  # the extra search was wrong
        group(3, "kb_1hop", [1.0, 1.0], [1, 1]),  # no signal
    ]
    m = rollout_metrics(HandOff(0, groups, []), step_s=2.0)
    assert m["rollout/reward/kb_2hop"] == pytest.approx(0.25) and m["rollout/reward/kb_1hop"] == 0.75
    assert m["rollout/num_searches/kb_2hop"] == pytest.approx(1.25)
    assert m["rollout/num_searches/kb_1hop"] == pytest.approx(1.25)
    assert m["rollout/equal_reward_groups/kb_2hop"] == 0.5 and m["rollout/equal_reward_groups/kb_1hop"] == 0.5
    # rewards [1, 0]: advantages +-0.5 / (unbiased std 0.7071) = +-0.7071; over the source's 4 trajectories
    push = 0.7071067 * (2 - 1) / 4
    assert m["rollout/search_advantage/kb_2hop"] == pytest.approx(push, rel=1e-5)
    assert m["rollout/search_advantage/kb_1hop"] == pytest.approx(-push, rel=1e-5)
    assert m["rollout/reward/mean"] == 0.5 and m["rollout/num_searches/mean"] == 1.25
    # without std normalisation the advantages are the centred rewards
    raw = rollout_metrics(HandOff(0, groups, []), step_s=2.0, norm_adv_by_std=False)
    assert raw["rollout/search_advantage/kb_2hop"] == pytest.approx(0.5 * 1 / 4)


def test_a_prompt_without_data_source_is_reported_as_unknown():
    m = rollout_metrics(HandOff(0, [group(0, "", [1.0, 0.0], [0, 1])], []), step_s=1.0)
    assert m["rollout/reward/unknown"] == 0.5 and not any(k.endswith("/") for k in m)
    assert math.isclose(m["throughput"], m["rollout/total_num_sequence"] * m["rollout/response_length"] / 1.0)
