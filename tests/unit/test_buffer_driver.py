"""The rollout driver over the buffer: admission limits respected under concurrency, hand-off, drain,
sync quota, failure propagation, and a dropped prompt coming again in the next epoch (real loader)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from tandemrl.buffer.rollout_buffer import BufferLimits, TaskBuffer
from tandemrl.data.loader import PromptLoader
from tandemrl.runner.prompt_feed import PromptFeed
from tandemrl.runner.rollout_driver import RolloutDriver


@dataclass
class Traj:
    weight_versions: list[int]
    reward: float


class ScriptedGroups:
    """Scripted completions: each group waits for `release()` and returns rewards chosen by prompt."""

    def __init__(self, equal_reward_prompts=()):
        self.gate = asyncio.Event()
        self.max_running = 0
        self.running = 0
        self.equal = set(equal_reward_prompts)
        self.driver = None

    def release(self):
        self.gate.set()

    async def __call__(self, prompt, group_size, engine, search, tokenizer, cfg):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await self.gate.wait()
        await asyncio.sleep(0)
        self.running -= 1
        version = self.driver.weight_version
        rewards = (
            [1.0] * group_size if prompt.prompt_id in self.equal else [float(i) for i in range(group_size)]
        )
        return [Traj([version], r) for r in rewards]


async def until(condition, timeout_s: float = 30.0) -> None:
    """Let the driver's tasks run until `condition()` holds (the timeout is a hang guard, not a timing)."""

    async def poll():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


async def settle() -> None:
    """Let every ready task run (the admission loop reacts to a change within a few loop turns), before
    checking that something did NOT happen (a limit held)."""
    for _ in range(50):
        await asyncio.sleep(0)


def write_prompts(path, num):
    rows = [
        {"id": str(i), "question": f"q{i}", "golden_answers": ["a"], "data_source": "kb_1hop"}
        for i in range(num)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_driver(tmp_path, scripted, num_prompts=20, quota=None, **limits):
    args = dict(
        rollout_batch_size=2, max_inflight_groups=3, max_buffered_groups=4, max_dropped_groups_per_step=20
    )
    args.update(limits)
    loader = PromptLoader([write_prompts(tmp_path / "train.jsonl", num_prompts)], seed=0, shuffle=False)
    buffer = TaskBuffer("t", BufferLimits(**args))
    driver = RolloutDriver(
        buffer,
        PromptFeed(loader, prefetch=2),
        engines=["e0", "e1"],
        search=None,
        tokenizer=None,
        agent_cfg=None,
        group_size=2,
        weight_version=0,
        run_group_fn=scripted,
        quota=quota,
    )
    scripted.driver = driver
    return driver


def test_admission_respects_both_limits_and_hands_off(tmp_path):
    async def main():
        scripted = ScriptedGroups()
        driver = make_driver(tmp_path, scripted)
        driver.start()
        await until(lambda: driver.buffer.num_inflight == 3)
        await settle()
        assert driver.buffer.num_inflight == 3 and scripted.max_running == 3  # in-flight limit
        scripted.release()
        handoff = await driver.next_handoff(0)
        assert [g.prompt_id for g in handoff.groups] == ["train:0", "train:1"]
        await until(lambda: driver.buffer.num_inflight + driver.buffer.num_buffered == 4)
        await settle()
        assert driver.buffer.num_inflight + driver.buffer.num_buffered == 4  # buffer-full limit
        await driver.stop()

    asyncio.run(main())


def test_sync_quota_and_pause_issue_exactly_one_batch(tmp_path):
    async def main():
        scripted = ScriptedGroups()
        driver = make_driver(tmp_path, scripted, quota=2)
        driver.start()
        scripted.release()
        handoff = await driver.next_handoff(0, pause_admission=True)
        await settle()
        assert len(handoff.groups) == 2 and driver.buffer.num_inflight == 0  # nothing issued while training
        assert driver.feed.num_drawn == 2
        driver.resume_admission()
        await until(lambda: driver.buffer.num_inflight + driver.buffer.num_buffered == 2)
        await settle()
        assert driver.buffer.num_inflight + driver.buffer.num_buffered == 2  # the quota: one batch
        await driver.stop()

    asyncio.run(main())


def test_drain_waits_for_every_inflight_group(tmp_path):
    async def main():
        scripted = ScriptedGroups()
        driver = make_driver(tmp_path, scripted)
        driver.start()
        await until(lambda: driver.buffer.num_inflight == 3)
        driver.pause_admission()
        waiter = asyncio.create_task(driver.wait_idle())
        await settle()
        assert not waiter.done()
        scripted.release()
        await asyncio.wait_for(waiter, 2)
        assert driver.buffer.num_inflight == 0 and driver.buffer.num_buffered == 3
        driver.set_weight_version(1)
        driver.resume_admission()
        handoff = await driver.next_handoff(1)
        assert handoff.metrics["rollout/data_staleness/mean"] == 1.0
        assert handoff.metrics["rollout/queue_steps/mean"] == 1.0
        await driver.stop()

    asyncio.run(main())


def test_a_failing_group_is_raised_to_the_runner(tmp_path):
    async def boom(*args):
        raise ConnectionError("engine e0 refused the connection")

    async def main():
        driver = make_driver(tmp_path, ScriptedGroups())
        driver._run_group = boom
        driver.start()
        with pytest.raises(ConnectionError, match="refused"):
            await asyncio.wait_for(driver.next_handoff(0), 2)
        await driver.stop()

    asyncio.run(main())


def test_dropped_prompt_comes_again_in_the_next_epoch(tmp_path):
    async def main():
        scripted = ScriptedGroups(equal_reward_prompts={"train:1"})
        driver = make_driver(
            tmp_path,
            scripted,
            num_prompts=3,
            reject_equal_reward=True,
            max_inflight_groups=1,
            max_buffered_groups=2,
        )
        driver.start()
        scripted.release()
        trained = []
        for _ in range(3):
            handoff = await driver.next_handoff(0)
            trained += [g.prompt_id for g in handoff.groups]
        await driver.stop()
        dropped = [e for e in driver.buffer.events() if e["event"] == "dropped"]
        assert len(dropped) >= 2 and all(e["prompt_id"] == "train:1" for e in dropped)  # once per epoch
        assert trained[:2] == ["train:0", "train:2"]  # epoch 0 without the dropped prompt
        assert driver.feed.loader.epoch >= 1 and trained.count("train:1") == 0
        assert trained.count("train:0") >= 2  # the next epoch brought the prompts again

    asyncio.run(main())


def test_async_admission_at_head_offpolicyness_zero_is_the_sync_schedule(tmp_path):
    """The async runner's driver (no quota, admission never paused) under max_head_offpolicyness 0
    issues what the sync runner's issues: the same prompts, one batch per weight version, and nothing
    while the actor trains on a hand-off."""

    async def steps(driver, is_sync: bool):
        scripted = driver._run_group
        scripted.release()
        driver.start()
        schedule = []
        for version in range(3):
            if is_sync:
                driver.resume_admission()
            handoff = await asyncio.wait_for(driver.next_handoff(version, pause_admission=is_sync), 5)
            await settle()  # "training": admission gets every chance to issue
            issued_while_training = driver.buffer.num_inflight + driver.buffer.num_buffered
            driver.set_weight_version(version + 1)
            await settle()
            schedule.append(
                ([g.prompt_id for g in handoff.groups], {g.issued_weight_version for g in handoff.groups})
            )
            assert issued_while_training == 0
            assert handoff.metrics["rollout/data_staleness/mean"] == 0.0
        await driver.stop()
        return schedule

    async def main():
        sync = await steps(make_driver(tmp_path / "s", ScriptedGroups(), quota=2), is_sync=True)
        asyn = await steps(
            make_driver(tmp_path / "a", ScriptedGroups(), max_head_offpolicyness=0, max_buffered_groups=8),
            is_sync=False,
        )
        assert asyn == sync
        assert sync == [
            (["train:0", "train:1"], {0}),
            (["train:2", "train:3"], {1}),
            (["train:4", "train:5"], {2}),
        ]

    (tmp_path / "s").mkdir()
    (tmp_path / "a").mkdir()
    asyncio.run(main())
