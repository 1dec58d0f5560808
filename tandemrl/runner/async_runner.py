"""The asynchronous runner: generation never stops for training.

    admission (buffer limits) ─► agent loops ─► engines ─────────── generate without pause ──┐
         ▲                                                                                   │
         │   rollout buffer ◄── finished groups (tokens stamped with their weight_version) ◄─┘
         │        │ hand-off: rollout_batch_size groups, stale / equal-reward ones dropped
         │        ▼
         │   actor.train_step (runs while the engines keep generating with version v)
         │        │
         └── sync weights: pause (retract | in_place) or drain ─► push v+1 ─► continue
                 (after the last step's validation, which runs beside this step: runner.overlap_validation)

A group handed off at version v may hold tokens of v-1, v-2, ... (staleness = v - earliest token
version, docs/DESIGN.md, Rollout buffer); how far behind it may be is bounded by max_buffered_groups and
agentloop.max_actor_accept_staleness.

On a GPU the actor and an engine share, `cluster.colocated_policy=time_share` (the default there) turns
the overlap into turns on the GPU, and keeps the overlap of everything else:

    hand-off ─► engines stand down (pause, keeping what they generated) ─► actor.train_step, GPU alone
        ─► push v+1 ─► continue          (agent loops, searches and admission never stop meanwhile)
"""

from __future__ import annotations

import logging

from tandemrl.runner.context import RunContext
from tandemrl.runner.step import (
    end_of_step,
    finish_validation,
    settle_pending,
    stand_down,
    start_clock,
    sync_weights,
    train_on,
    validate_before_training,
    wait_for_data,
)
from tandemrl.runner.step_metrics import engine_busy_fraction, retrieval_load

log = logging.getLogger(__name__)


async def run_async(ctx: RunContext) -> None:
    driver, runner = ctx.driver, ctx.config.runner
    driver.quota = None  # only the buffer's limits bound admission
    await validate_before_training(ctx)
    await engine_busy_fraction(ctx)  # the first step's busy window starts here
    await retrieval_load(ctx)  # and the retrieval server's
    is_time_share = ctx.engines_stand_down
    start_clock(ctx)
    driver.start()
    try:
        for step in range(ctx.start_step + 1, runner.max_steps + 1):
            handoff, wait_metrics = await wait_for_data(ctx)
            if is_time_share:
                wait_metrics.update(await stand_down(ctx))
            # concurrent: the engines keep generating meanwhile, and the last step's validation runs on
            train_metrics = await train_on(ctx, handoff, step)
            wait_metrics.update(await finish_validation(ctx))  # before its step's weights leave the engines
            sync_metrics = await sync_weights(ctx, ctx.weight_version + 1, is_stood_down=is_time_share)
            metrics = {**wait_metrics, **train_metrics, **sync_metrics}
            await end_of_step(ctx, step, handoff, metrics, ctx.may_overlap_validation)
    finally:
        await settle_pending(ctx)
