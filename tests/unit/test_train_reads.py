"""The engines' counters around a train step (runner/step.py `train_on`): read on the actor's path only
when the engines are stood down or idle, where the figure is exact; beside the train step when they
generate meanwhile, where a read waits behind the engine's own steps (docs/DESIGN.md, The step clock).
The engine and the actor are fakes standing in for their processes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandemrl.runner.step import settle_pending, take_train_reads, train_on


class FakeEngineCounters:
    """An engine's /get_server_info counters. `answer_after`: an event its answer waits for (an engine
    busy with its own steps); `log` records when each answer leaves."""

    def __init__(self, log: list[str], answer_after: asyncio.Event | None = None):
        self.num_steps = 10
        self.log = log
        self.answer_after = answer_after

    async def server_info(self) -> dict:
        if self.answer_after is not None:
            await self.answer_after.wait()
        self.log.append(f"read {self.num_steps}")
        return {
            "num_steps": self.num_steps,
            "num_prefill_tokens": 100,
            "num_decode_tokens": 7 * self.num_steps,
        }


class FakeActor:
    """The actor's train step: lets the engine answer (when it waits), then the engine steps 3 times."""

    def __init__(self, engine: FakeEngineCounters, started: asyncio.Event):
        self.engine, self.started = engine, started

    async def call(self, method: str, samples, *args) -> dict:
        assert method == "train_step" and len(samples) == 2
        self.engine.log.append("train starts")
        self.started.set()
        await asyncio.sleep(0.01)
        self.engine.num_steps += 3
        self.engine.log.append("train ends")
        return {"time/train_step": 0.01}


def fake_ctx(engine, actor, generating: bool):
    trajectory = SimpleNamespace(
        prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2], reward=1.0
    )
    config = SimpleNamespace(
        rollout=SimpleNamespace(backend="embedded"),
        runner=SimpleNamespace(profile_steps=[]),
        algorithm=SimpleNamespace(norm_adv_by_std=True, proximal_logprobs="recompute"),
    )
    return SimpleNamespace(
        config=config,
        engines=[engine],
        actor=actor,
        engines_generate_while_training=generating,
        train_reads=None,
        bookkeeping=None,
        pending_validation=None,
        is_first_step_done=True,
    ), SimpleNamespace(groups=[SimpleNamespace(trajectories=[trajectory, trajectory])])


def test_reads_go_beside_the_train_step_while_the_engines_generate():
    async def main():
        log: list[str] = []
        started = asyncio.Event()
        engine = FakeEngineCounters(log, answer_after=started)  # answers only once training has begun
        ctx, handoff = fake_ctx(engine, FakeActor(engine, started), generating=True)
        metrics = await asyncio.wait_for(train_on(ctx, handoff, step=1), timeout=10)
        assert "rollout/engine_steps_during_train" not in metrics  # it joins the row in the bookkeeping
        assert metrics["time/engine_reads"] >= 0 and metrics["time/samples"] >= 0
        reads = await asyncio.wait_for(take_train_reads(ctx), timeout=10)
        assert ctx.train_reads is None and await take_train_reads(ctx) == {}
        return log, reads

    log, reads = asyncio.run(main())
    # the train step did not wait for the first answer, which came while it ran
    assert log == ["train starts", "read 10", "train ends", "read 13"], log
    assert reads == {
        "rollout/engine_steps_during_train": 3,
        "rollout/engine_prefill_tokens_during_train": 0,
        "rollout/engine_decode_tokens_during_train": 21,
    }


def test_reads_are_awaited_around_the_train_step_when_the_engines_do_not_generate():
    """Stood down (`time_share`) or idle (sync): both answers are in before the train step returns."""

    async def main():
        log: list[str] = []
        engine = FakeEngineCounters(log)
        ctx, handoff = fake_ctx(engine, FakeActor(engine, asyncio.Event()), generating=False)
        await train_on(ctx, handoff, step=1)
        answered = list(log)
        return answered, await take_train_reads(ctx)

    log, reads = asyncio.run(main())
    assert log == ["read 10", "train starts", "train ends", "read 13"], log
    assert reads["rollout/engine_steps_during_train"] == 3


def test_reads_left_by_a_run_that_stops_are_cancelled():
    async def main():
        log: list[str] = []
        engine = FakeEngineCounters(log, answer_after=asyncio.Event())  # never answers
        ctx, _ = fake_ctx(engine, None, generating=True)
        never = asyncio.ensure_future(engine.server_info())
        ctx.train_reads = never
        await settle_pending(ctx)
        await asyncio.sleep(0)
        return never, ctx

    never, ctx = asyncio.run(main())
    assert never.cancelled() and ctx.train_reads is None


def test_loglinear_hands_the_actor_each_token_lag_behind_its_weights():
    async def main():
        log: list[str] = []
        engine = FakeEngineCounters(log)
        handed: list = []

        class KeepingActor:
            async def call(self, method, samples, *args):
                handed.extend(samples)
                return {}

        ctx, handoff = fake_ctx(engine, KeepingActor(), generating=False)
        ctx.config.algorithm.proximal_logprobs = "loglinear"
        ctx.weight_version = 5
        for trajectory in handoff.groups[0].trajectories:
            trajectory.weight_versions = [3, 5]
        await train_on(ctx, handoff, step=6)
        return handed

    handed = asyncio.run(main())
    assert [s.lags for s in handed] == [[0, 0, 2, 0], [0, 0, 2, 0]]
