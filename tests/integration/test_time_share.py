"""`cluster.colocated_policy`: the async runner's two ways of sharing a device between the actor and the
engines, end to end on CPU (real engine process, real retrieval server, tiny actor in the driver).

time_share must stand the engines down for the whole train step: the engine's own step counter does
not move between the moment `actor.train_step` starts and the moment it returns, in every step, while
the engines still generate between the steps; and no prompt is lost or trained twice. To make the
check able to fail, the train step is held open for a while (or, under concurrent, until the engine has
stepped): a paused engine cannot step however long training takes, a running one does.
"""

from __future__ import annotations

import time

import pytest

from tandemrl.cluster.actor_worker import ActorWorker
from tandemrl.commands.train import train
from tandemrl.config.loader import load_config
from tandemrl.metrics.logger import read_history
from tests.integration.runner_helpers import account, read_ledger, small_kb_once, tiny_overrides

HOLD_S = {"time_share": 1.0, "concurrent": 60.0}  # concurrent: held only until the engine has stepped


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


def hold_train_step_open(monkeypatch, policy: str, seen: list[tuple[int, int]]) -> None:
    """Wrap ActorWorker.train_step: read the engine's step counter at its start and end (inside the
    actor, not around the driver's call), polling in between for up to HOLD_S[policy] seconds."""
    original = ActorWorker.train_step

    def num_steps(worker) -> int:
        info = worker._loop.run_until_complete(worker._clients[0].server_info())
        return int(info["num_steps"])

    def train_step(self, samples, profile_path=None):
        start = num_steps(self)
        deadline = time.monotonic() + HOLD_S[policy]
        while time.monotonic() < deadline and not (policy == "concurrent" and num_steps(self) > start):
            time.sleep(0.05)
        metrics = original(self, samples, profile_path)
        seen.append((start, num_steps(self)))
        return metrics

    monkeypatch.setattr(ActorWorker, "train_step", train_step)


@pytest.mark.parametrize(
    ("policy", "pause_mode"),
    [("time_share", "retract"), ("time_share", "in_place"), ("concurrent", "retract")],
)
def test_time_share_never_generates_while_the_actor_trains(
    tmp_path, tiny_llama_dir, small_kb, monkeypatch, policy, pause_mode
):
    kb_dir, index_dir = small_kb
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + [
        "runner.async_mode=true",
        "runner.val_interval=0",
        f"cluster.colocated_policy={policy}",
        f"rollout.pause_mode={pause_mode}",
    ]
    seen: list[tuple[int, int]] = []
    hold_train_step_open(monkeypatch, policy, seen)
    config = load_config(None, overrides)
    ctx = train(config, write_plots=False)
    assert ctx.colocated_policy == policy
    rows = [row for row in read_history(tmp_path / "run" / "metrics.jsonl") if row["step"] >= 1]
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and len(seen) == 4
    during = [row["rollout/engine_steps_during_train"] for row in rows]
    decoded = [row["rollout/engine_busy_fraction"] for row in rows[1:]]  # step 1 has no earlier read
    # The engine generated between train steps, so the checks below are live. Not in every window: once the
    # groups the run still needs are all done (the last window's, often), a window has nothing to generate,
    # and when that happens depends on the machine's speed (a CI run under load saw 0.0 in the last one).
    assert any(busy > 0 for busy in decoded), decoded
    if policy == "time_share":
        assert all(end == start for start, end in seen), seen  # not one engine step inside train_step
        assert during == [0.0] * 4, during
        assert all(row["time/stand_down"] >= 0 for row in rows)
    else:
        assert all(end > start for start, end in seen), seen  # the engine kept generating meanwhile
        assert all(steps > 0 for steps in during), during
        assert not any("time/stand_down" in row for row in rows)
    unfinished = {g.issue_id for g in ctx.driver.buffer.unfinished_groups()}
    sets = account(read_ledger(tmp_path / "run"), unfinished)  # every issued group ends exactly once
    assert len(sets["trained"]) == 8
    assert len(sets["trained_prompts"]) == len(set(sets["trained_prompts"]))  # no prompt trained twice
    assert ctx.weight_version == 4


def test_time_share_refuses_what_contradicts_it():
    from tandemrl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"colocated_policy=time_share with rollout.pause_mode=drain"):
        load_config(None, ["cluster.colocated_policy=time_share", "rollout.pause_mode=drain"])
    with pytest.raises(ConfigError, match=r"mps_sm_percent.*time_share.*Remove cluster.mps_sm_percent"):
        load_config(
            None,
            [
                "cluster.colocated_policy=time_share",
                "cluster.mps=true",
                "cluster.mps_sm_percent={rollout: 30}",
            ],
        )
    with pytest.raises(ConfigError, match=r"cluster.colocated_policy='sometimes': must be one of"):
        load_config(None, ["cluster.colocated_policy=sometimes"])
