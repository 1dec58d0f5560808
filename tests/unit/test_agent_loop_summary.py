"""The evaluation summary: EM per data source and overall, mean searches and turns."""

from __future__ import annotations

from tandemrl.agent.evaluate import format_summary, summarize
from tandemrl.agent.loop import Trajectory


def traj(source: str, em: float, searches: int, turns: int, answer: str | None = "x") -> Trajectory:
    return Trajectory(
        prompt_ids=[1],
        response_ids=[2] * 10,
        loss_mask=[1] * 10,
        rollout_logprobs=[-1.0] * 10,
        weight_versions=[0] * 10,
        searches=["q"] * searches,
        num_turns=turns,
        reward=em,
        em=em,
        data_source=source,
        answer=answer,
        num_search_errors=searches // 2,
    )


def test_summary_per_source_and_overall():
    trajectories = [
        traj("kb_1hop", 1.0, 1, 2),
        traj("kb_1hop", 0.0, 3, 4, answer=None),
        traj("kb_2hop", 1.0, 2, 3),
    ]
    summary = summarize(trajectories)
    assert list(summary) == ["kb_1hop", "kb_2hop", "overall"]
    assert summary["kb_1hop"] == {
        "num": 2,
        "em": 0.5,
        "reward": 0.5,
        "searches": 2.0,
        "turns": 3.0,
        "response_length": 10.0,
        "answered": 0.5,
        "search_errors": 1,
    }
    assert summary["overall"]["em"] == 2 / 3 and summary["overall"]["searches"] == 2.0
    assert summary["kb_2hop"]["num"] == 1 and summary["kb_2hop"]["search_errors"] == 1


def test_em_is_not_the_format_reward():
    """With the format score on, a correct but malformed answer has reward 0.8 and EM 1."""
    trajectory = traj("nq", 1.0, 0, 1)
    trajectory.reward = 0.8
    summary = summarize([trajectory])
    assert summary["nq"]["em"] == 1.0 and summary["nq"]["reward"] == 0.8


def test_table_lists_every_source():
    table = format_summary(summarize([traj("kb_1hop", 1.0, 1, 2), traj("kb_2hop", 0.0, 0, 1)]))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["source", "num", "em"]
    assert [line.split()[0] for line in lines[1:]] == ["kb_1hop", "kb_2hop", "overall"]
    assert lines[-1].split()[1:3] == ["2", "0.500"]
