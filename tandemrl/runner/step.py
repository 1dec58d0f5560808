"""The pieces of a step both runners share: wait for a hand-off, train on it, sync weights under
`rollout.pause_mode`, validate, then `end_of_step` (ledger, trajectories, checkpoint, metrics).

Invariant: `ctx.weight_version` moves only in `sync_weights`, after the engines hold the new weights.
Step-time breakdown, every step: time/wait_data (the actor waiting for a hand-off), time/samples (the
hand-off turned into train samples), time/engine_reads (the engines' counters read around the train
step), time/train, time/sync_weights (= its pause + push + continue parts), and, for embedded engines,
the engines' busy fraction over the step window (runner/step_metrics.py); `metrics/logger.py` names the
bottleneck.

The clock is the wall clock (docs/DESIGN.md, The step clock): `time/step` runs from the end of one step to
the end of the next, validation and checkpoints included (`time/validation`, `time/checkpoint` say how
much of it they took), so the steps' times add up to the run's wall time from the first step's start
(`time/wall`, cumulative). Both runners keep generating training rollouts while they validate, and with
`runner.overlap_validation` both run a validation beside the next step (`finish_validation`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from tandemrl.buffer.rollout_buffer import HandOff
from tandemrl.runner.context import RunContext
from tandemrl.runner.records import write_ledger, write_trajectories
from tandemrl.runner.step_metrics import (
    engine_busy_fraction,
    engine_counters,
    launched_spec_reads,
    retrieval_load,
    rollout_metrics,
    warn_on_search_errors,
)

log = logging.getLogger(__name__)

# the named parts of `time/step`; `time/other` is the rest (end_of_step)
STEP_PARTS = (
    "time/wait_data",
    "time/stand_down",
    "time/samples",
    "time/engine_reads",
    "time/train",
    "time/wait_validation",
    "time/sync_weights",
    "time/wait_bookkeeping",
    "time/validation",
    "time/records",
    "time/checkpoint",
)
# how long a run that stops waits for the last step's bookkeeping (`settle_pending`): on an error, the error
# that ended the run is the one to report, and a hung server must not hang the exit
SETTLE_TIMEOUT_S = 30.0


@dataclass
class PendingValidation:
    """A step's validation running beside the next step (`runner.overlap_validation`): the step's metrics
    wait here for its val metrics, so the step keeps one row in metrics.jsonl."""

    step: int
    task: asyncio.Task
    metrics: dict[str, float] | None = None  # the step's row, once its bookkeeping has made it


async def wait_for_data(ctx: RunContext, pause_admission: bool = False) -> tuple[HandOff, dict[str, float]]:
    """The next hand-off, and how long the actor waited for it (`time/wait_data`)."""
    start_s = time.monotonic()
    handoff = await ctx.driver.next_handoff(ctx.weight_version, pause_admission=pause_admission)
    mark_first_step(ctx, "generation done (hand-off taken)")
    return handoff, {"time/wait_data": time.monotonic() - start_s}


async def train_on(ctx: RunContext, handoff: HandOff, step: int) -> dict[str, float]:
    """One actor train step on the hand-off. A step in `runner.profile_steps` is recorded into
    <output_dir>/profiles/train_step_<step>.*.

    For embedded engines, `rollout/engine_steps_during_train` (and the tokens those steps prefilled and
    decoded) come from the engines' counters read around the step (`ctx.train_reads`, which the step's
    bookkeeping adds to its row). Engines that are stood down (`time_share`) or idle (sync) answer at once
    and nothing moves while the reads are in flight: they are awaited, and the figure is exact (0 under
    time-sharing, by construction). Engines that generate meanwhile answer only between their own steps,
    behind the requests they run: those reads go beside the train step, off the actor's path, and the
    figure is the engines' steps between the two answers."""
    from tandemrl.trainer.advantages import samples_from_trajectories

    start_s = time.monotonic()
    algorithm = ctx.config.algorithm
    # each token's lag behind the actor's weights, for the loglinear proximal policy only
    actor_version = ctx.weight_version if algorithm.proximal_logprobs == "loglinear" else None
    samples = samples_from_trajectories(
        [g.trajectories for g in handoff.groups], algorithm.norm_adv_by_std, actor_version
    )
    samples_s = time.monotonic() - start_s
    args: list[Any] = [samples]
    if step in ctx.config.runner.profile_steps:
        args.append(str((ctx.output_dir / "profiles" / f"train_step_{step}").resolve()))
    is_beside = ctx.engines_generate_while_training
    start_s = time.monotonic()
    before = asyncio.ensure_future(engine_counters(ctx))
    if not is_beside:
        await before
    reads_s = time.monotonic() - start_s
    start_s = time.monotonic()
    try:
        metrics = dict(await ctx.actor.call("train_step", *args))
    except BaseException:
        before.cancel()
        raise
    metrics["time/train"] = time.monotonic() - start_s
    start_s = time.monotonic()
    after = asyncio.ensure_future(engine_counters(ctx))
    if not is_beside:
        await after
    ctx.train_reads = asyncio.ensure_future(counters_during(before, after))
    # on the actor's path: the samples are built on the event loop the agents share, and the reads
    # (when awaited) wait for the engines' answers (docs/DESIGN.md, The step clock)
    metrics["time/engine_reads"] = reads_s + time.monotonic() - start_s
    metrics["time/samples"] = samples_s
    mark_first_step(ctx, "train done")
    return metrics


async def counters_during(before: Awaitable, after: Awaitable) -> dict[str, float]:
    """What the engines ran between two reads of their counters (`engine_counters`); empty for backends
    that report none."""
    first, last = await before, await after
    if first is None or last is None:
        return {}
    metrics = {"rollout/engine_steps_during_train": last["num_steps"] - first["num_steps"]}
    for key in ("prefill", "decode"):
        counter = f"num_{key}_tokens"
        metrics[f"rollout/engine_{key}_tokens_during_train"] = last[counter] - first[counter]
    return metrics


async def take_train_reads(ctx: RunContext) -> dict[str, float]:
    """This step's `counters_during` figures (`train_on`), once."""
    reads, ctx.train_reads = ctx.train_reads, None
    return {} if reads is None else await reads


async def stand_down(ctx: RunContext) -> dict[str, float]:
    """Time-sharing a GPU (`cluster.colocated_policy=time_share`): pause every engine with
    `rollout.pause_mode` (retract or in_place: what was generated is kept) before the actor trains, so
    the actor has the GPU to itself; `sync_weights(..., is_stood_down=True)` pushes and continues them.
    Agent loops keep running meanwhile: searches finish and their next turns queue in the paused engines."""
    start_s = time.monotonic()
    mode = ctx.config.rollout.pause_mode
    await asyncio.gather(*(engine.pause_generation(mode) for engine in ctx.engines))
    return {"time/stand_down": time.monotonic() - start_s}


async def sync_weights(ctx: RunContext, weight_version: int, is_stood_down: bool = False) -> dict[str, float]:
    """Push the actor's weights to every engine as `weight_version`; returns time/sync_weights, its
    pause, push and continue parts, and bytes.

    retract / in_place: the engines pause (in-flight requests are retracted to the queue, or keep
    their KV cache in place), take the weights, and continue. drain: admission stops and every
    in-flight group finishes first (SGLang has no such mode, so the client realises it). Marking the
    version on the clients before `continue_generation` is what stamps streamed tokens (docs/BACKENDS.md).
    `is_stood_down`: `stand_down` already paused them (its time is `time/stand_down`, not the pause's).
    An in_place update that lands between two engine steps (`ctx.atomic_weight_updates`: CUDA IPC to the
    embedded engine) needs no pause: the engines generate through the push, and the pause and continue
    parts are 0 (on the H200 they were ~0.1 s a step of the driver's and the engine's HTTP, for ~6 ms of
    the engine's own work; benchmarks/results/runner/colocated_h200_buffer4/COMMAND.md).
    """
    mode = ctx.config.rollout.pause_mode
    is_atomic_in_place = mode == "in_place" and ctx.atomic_weight_updates and not is_stood_down
    marks_s = [time.monotonic()]  # start, paused, pushed, continued
    answers: list = []
    was_paused = ctx.driver.is_paused  # the sync runner keeps admission closed until its next step
    if is_stood_down:
        assert mode != "drain", "time-sharing never stands down with drain (config/derive.py refuses it)"
    elif mode == "drain":
        ctx.driver.pause_admission()
        await ctx.driver.wait_idle()
    elif not is_atomic_in_place:
        answers = await asyncio.gather(*(engine.pause_generation(mode) for engine in ctx.engines))
    marks_s.append(time.monotonic())
    try:
        pushed = await ctx.actor.call("push_weights", weight_version)
        for engine in ctx.engines:  # the update boundary: tokens received from here on are the new version
            engine.mark_weight_version(weight_version)
    finally:
        marks_s.append(time.monotonic())
        if mode != "drain" and not is_atomic_in_place:
            await asyncio.gather(*(engine.continue_generation() for engine in ctx.engines))
    ctx.weight_version = weight_version
    ctx.driver.set_weight_version(weight_version)
    mark_first_step(ctx, "weight sync done")
    if mode == "drain" and not was_paused:
        ctx.driver.resume_admission()
    marks_s.append(time.monotonic())
    metrics = {
        "time/sync_weights": marks_s[3] - marks_s[0],
        "time/sync_weights/pause": marks_s[1] - marks_s[0],
        "time/sync_weights/push": marks_s[2] - marks_s[1],
        "time/sync_weights/continue": marks_s[3] - marks_s[2],
        "sync_weights/bytes": float(pushed.get("sync_weights/bytes", 0.0)),
        **pause_metrics(answers),
    }
    log.info(
        "weight version %d on %d engine(s), rollout.pause_mode=%s%s: pause %.2f s, push %.2f s, continue %.2f s",
        weight_version,
        len(ctx.engines),
        mode,
        " (atomic, no pause)" if is_atomic_in_place else " (stood down)" if is_stood_down else "",
        metrics["time/sync_weights/pause"],
        metrics["time/sync_weights/push"],
        metrics["time/sync_weights/continue"],
    )
    return metrics


def pause_metrics(answers: list) -> dict[str, float]:
    """The slowest engine's pause, split where the embedded engine reports it (engine/loop.py): waiting for its
    loop thread (`rollout/engine_pause_queued_ms`) and draining the step in flight (`.._drain_ms`); the rest of
    `time/sync_weights/pause` is HTTP and the driver's own event loop. Other backends report nothing."""
    metrics = {}
    for key in ("pause_queued_s", "pause_drain_s"):
        values = [float(a[key]) for a in answers if isinstance(a, dict) and key in a]
        if values:
            metrics[f"rollout/engine_{key[:-2]}_ms"] = 1000 * max(values)
    return metrics


async def validate(ctx: RunContext) -> dict[str, float]:
    """Greedy EM and searches per trajectory on the validation prompts, per data source and overall
    (`val/em/<source>`, `val/em/all`, `val/num_searches/<source>`, `val/num_searches/all`), and the range of
    weight versions that generated them (`val/weight_version/min`, `/max`)."""
    from tandemrl.agent.evaluate import OVERALL, evaluate_prompts, summarize

    if not ctx.val_prompts:
        return {}
    driver, num_engines = ctx.driver, len(ctx.engines)
    shards = [ctx.val_prompts[i::num_engines] for i in range(num_engines)]
    # as many trajectories at once as an engine runs requests, as `tandem evaluate` does: each is a chain of
    # turns and searches, so 200 prompts 64 at a time took three chains' time (4.5-5.4 s on the H200 recipe
    # beside training, colocated_h200_overlap/), where one chain's would do
    concurrency = ctx.config.rollout.max_running_requests
    results = await asyncio.gather(
        *(
            evaluate_prompts(shard, engine, driver.search, driver.tokenizer, driver.agent_cfg, concurrency)
            for shard, engine in zip(shards, ctx.engines, strict=True)
            if shard
        )
    )
    trajectories = [traj for shard in results for traj in shard]
    summary = summarize(trajectories)
    metrics = {}
    # the weight versions that generated the validation's tokens: the step's own, also when it ran beside
    # the next step (the sync waits for it)
    versions = [
        v for t in trajectories for v in (t.min_weight_version, t.max_weight_version) if v is not None
    ]
    if versions:
        metrics["val/weight_version/min"] = float(min(versions))
        metrics["val/weight_version/max"] = float(max(versions))
    for source, row in summary.items():
        name = "all" if source == OVERALL else source
        metrics[f"val/em/{name}"] = row["em"]
        metrics[f"val/num_searches/{name}"] = row["searches"]
    return metrics


async def timed_validation(ctx: RunContext) -> tuple[dict[str, float], float]:
    """`validate`, and how long it took."""
    start_s = time.monotonic()
    metrics = await validate(ctx)
    return metrics, time.monotonic() - start_s


async def validate_in_step(ctx: RunContext, metrics: dict[str, float]) -> None:
    """Validate inside the step's own time: its val metrics and `time/validation` join `metrics`."""
    val_metrics, metrics["time/validation"] = await timed_validation(ctx)
    metrics.update(val_metrics)


async def finish_validation(ctx: RunContext) -> dict[str, float]:
    """Wait for the validation of an earlier step that ran beside this one (`end_of_step` with
    `may_overlap_validation`), then log that step's row with its val metrics. Runners call it before a
    weight sync, so the validation scored the weights of its own step. Returns `time/wait_validation`,
    the part of this step spent waiting for it (and for that step's bookkeeping, which makes its row)."""
    pending = ctx.pending_validation
    if pending is None:
        return {}
    start_s = time.monotonic()
    try:
        await finish_bookkeeping(ctx)  # the validating step's row is made there
        assert pending.metrics is not None, "the step's bookkeeping makes its row"
        val_metrics, validation_s = await pending.task
    except BaseException:
        if pending.metrics is not None:
            log_step(ctx, pending.step, pending.metrics)  # the step's row is kept, without what failed
        raise
    finally:
        ctx.pending_validation = None
    wait_s = time.monotonic() - start_s
    # its time ran beside the next step, so it is not a part of its own step's clock
    log_step(
        ctx, pending.step, {**pending.metrics, **val_metrics, "time/validation_overlapped": validation_s}
    )
    return {"time/wait_validation": wait_s}


async def finish_bookkeeping(ctx: RunContext) -> float | None:
    """Wait for the last step's bookkeeping (`end_of_step`), re-raising what failed there; returns how long
    it waited, None when none was running."""
    task = ctx.bookkeeping
    if task is None:
        return None
    start_s = time.monotonic()
    try:
        await task
    finally:
        ctx.bookkeeping = None
    return time.monotonic() - start_s


async def settle_pending(ctx: RunContext) -> None:
    """A run that stops (at its end, or on an error) with a step's bookkeeping or validation still running:
    the bookkeeping may finish (its records and row are kept; on an error it gets SETTLE_TIMEOUT_S, and
    its own failure is logged, not raised over the run's), the validation is cancelled and its step's row
    logged without it."""
    if ctx.train_reads is not None:  # a step that stopped between its train step and its end
        ctx.train_reads.cancel()
        ctx.train_reads = None
    task = ctx.bookkeeping
    if task is not None:
        ctx.bookkeeping = None
        done, _ = await asyncio.wait([task], timeout=SETTLE_TIMEOUT_S)
        if not done:
            task.cancel()
            log.warning(
                "the last step's bookkeeping did not finish within %.0f s; cancelled", SETTLE_TIMEOUT_S
            )
        elif not task.cancelled() and task.exception() is not None:
            log.warning("the last step's bookkeeping failed: %r", task.exception())
    pending = ctx.pending_validation
    if pending is None:
        return
    ctx.pending_validation = None
    pending.task.cancel()
    await asyncio.gather(pending.task, return_exceptions=True)
    if pending.metrics is not None:
        log_step(ctx, pending.step, pending.metrics)


async def validate_before_training(ctx: RunContext) -> None:
    """`runner.val_before_train`: the starting val EM, logged at the start step (0 on a fresh run)
    before any rollout, so the step clock (`start_clock`) starts after it."""
    if not (ctx.config.runner.val_before_train and ctx.val_prompts):
        return
    ctx.logger.log(ctx.start_step, await validate(ctx), advance=False)


def start_clock(ctx: RunContext) -> None:
    """The first step starts now: `time/wall` counts from here, and the first `time/step` too."""
    ctx.clock_start_s = ctx.last_step_end_s = time.monotonic()
    if ctx.loop_monitor is not None:
        ctx.loop_monitor.take()  # the first step's window of the driver's loop starts with its clock


async def end_of_step(
    ctx: RunContext,
    step: int,
    handoff: HandOff,
    metrics: dict[str, float],
    may_overlap_validation: bool = False,
) -> None:
    """Everything after the weight sync: validation, the step's records and metrics, checkpoint. The step
    ends here, and `time/step` covers what it waited for (docs/DESIGN.md, The step clock).

    The step's bookkeeping (the engines' and retrieval server's step-window reads, the ledger lines and
    trained trajectories, the step's metrics and their row) runs beside the next step (`ctx.bookkeeping`,
    `time/bookkeeping_overlapped` its length; the next step waits for it before its own, or before its
    validation's row: `time/wait_bookkeeping`). `may_overlap_validation` (the runner's:
    `runner.overlap_validation`, and the engines are not stood down for training): a validation runs beside
    the next step too, whose `finish_validation` waits for it before its weight sync; this step's row is
    logged then (`time/validation_overlapped` its length, `time/wait_validation` the next step's wait).
    A step that saves (the last one among them) does all of it in its own time, so its checkpoint follows
    a complete ledger and row."""
    from tandemrl.runner.checkpoint import save_checkpoint

    runner = ctx.config.runner
    metrics = dict(metrics)
    waited_s = await finish_bookkeeping(ctx)  # the last step's: its ledger lines and row come first
    if waited_s is not None:
        metrics["time/wait_bookkeeping"] = waited_s
    metrics["rollout/weight_version"] = float(ctx.weight_version)
    is_saving = bool(runner.save_interval and step % runner.save_interval == 0) or step == runner.max_steps
    is_validating = bool(runner.val_interval and step % runner.val_interval == 0)
    validation: PendingValidation | None = None
    if not is_saving:
        if is_validating and may_overlap_validation:
            task = asyncio.create_task(timed_validation(ctx), name=f"validation at step {step}")
            validation = ctx.pending_validation = PendingValidation(step, task)
        elif is_validating:
            await validate_in_step(ctx, metrics)
        events = ctx.driver.buffer.events()  # this step's ledger lines, taken now
        train_reads, ctx.train_reads = ctx.train_reads, None  # the next step's train_on sets its own
        step_s = close_step(ctx, metrics)
        ctx.bookkeeping = asyncio.create_task(
            bookkeep(ctx, step, handoff, events, metrics, step_s, validation, train_reads),
            name=f"bookkeeping of step {step}",
        )
    else:
        metrics.update(await take_train_reads(ctx))
        metrics.update(await step_window_reads(ctx))
        if is_validating:
            await validate_in_step(ctx, metrics)
        start_s = time.monotonic()
        write_ledger(ctx, step)
        write_trajectories(ctx, step, handoff)
        metrics["time/records"] = time.monotonic() - start_s  # prompts.jsonl and trajectories/
        start_s = time.monotonic()
        # the row is logged after the save (it times it): the save keeps it so far, in case of a kill between
        await save_checkpoint(ctx, step, step_row(ctx, handoff, metrics, start_s - ctx.last_step_end_s))
        metrics["time/checkpoint"] = time.monotonic() - start_s
        step_s = close_step(ctx, metrics)
        log_step(ctx, step, step_row(ctx, handoff, metrics, step_s))
    if step != ctx.start_step + 1:
        return
    mark_first_step(ctx, "done")
    ctx.is_first_step_done = True
    if ctx.started_s is not None:
        ctx.first_step_s = ctx.last_step_end_s - ctx.started_s
        log.info("time to first step: %.1f s (process start to the end of step %d)", ctx.first_step_s, step)
    report_startup(ctx)


async def step_window_reads(ctx: RunContext) -> dict[str, float]:
    """The engines' and the retrieval server's figures over the step window, read side by side."""
    metrics: dict[str, float] = {}
    for reads in await asyncio.gather(
        engine_busy_fraction(ctx), retrieval_load(ctx), launched_spec_reads(ctx)
    ):
        metrics.update(reads)
    return metrics


def close_step(ctx: RunContext, metrics: dict[str, float]) -> float:
    """The step ends now: its time (`time/step`, set by `step_row`) and `time/wall`; the next starts."""
    now_s = time.monotonic()
    if ctx.clock_start_s is None:  # a caller that never started the clock: its first step starts at creation
        ctx.clock_start_s = ctx.last_step_end_s
    step_s = now_s - ctx.last_step_end_s
    metrics["time/wall"] = now_s - ctx.clock_start_s
    ctx.last_step_end_s = now_s
    if ctx.loop_monitor is not None:
        metrics.update(loop_metrics(ctx, ctx.loop_monitor.take(), metrics["time/wall"]))
    return step_s


def loop_metrics(ctx: RunContext, window: dict, wall_s: float) -> dict[str, float]:
    """The step's window of the driver's event loop (host/loop_monitor.py): `driver/loop_late_s` (its timer's
    lateness summed: time the loop ran other callbacks first), `driver/loop_max_late_ms`, and
    `driver/loop_stalled_s` (held past 50 ms at a stretch); what held it goes to loop_stalls.jsonl, a line
    per step that stalled (`wall`: the step's end on the run's clock, its row's `time/wall`), the code
    locations with their seconds."""
    if window["stalled_s"] > 0:
        line = {"wall": wall_s, "stalled_s": window["stalled_s"], "where": window["where"]}
        with open(ctx.output_dir / "loop_stalls.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")
    return {
        "driver/loop_late_s": window["late_s"],
        "driver/loop_max_late_ms": window["max_late_ms"],
        "driver/loop_stalled_s": window["stalled_s"],
    }


def step_row(ctx: RunContext, handoff: HandOff, metrics: dict[str, float], step_s: float) -> dict[str, float]:
    """The step's row: its rollout metrics, its parts, and `time/other`."""
    metrics = {**rollout_metrics(handoff, step_s, ctx.config.algorithm.norm_adv_by_std), **metrics}
    # the step's time outside its named parts: the driver's own work between them (building the samples,
    # the engines' counters around the train step), on the event loop the agents share
    metrics["time/other"] = metrics["time/step"] - sum(metrics.get(key, 0.0) for key in STEP_PARTS)
    if "rollout/engine_decode_rows" in metrics and metrics.get("rollout/total_num_sequence"):
        # the window's decode rows (validation's included when it ran) over the hand-off's trajectories
        num_rows = metrics["rollout/engine_decode_rows"]
        metrics["rollout/spec/decode_steps_per_trajectory"] = num_rows / metrics["rollout/total_num_sequence"]
    return metrics


async def bookkeep(
    ctx: RunContext,
    step: int,
    handoff: HandOff,
    events: list[dict],
    metrics: dict[str, float],
    step_s: float,
    validation: PendingValidation | None,
    train_reads: Awaitable[dict[str, float]] | None = None,
) -> None:
    """A step's bookkeeping beside the next step (`end_of_step`); its row waits for its validation, if one
    runs (`finish_validation` logs it). `train_reads`: the engines' counters around its train step
    (`train_on`)."""
    start_s = time.monotonic()
    reads = await step_window_reads(ctx)
    if train_reads is not None:
        reads.update(await train_reads)
    write_ledger(ctx, step, events)
    # the trained trajectories as JSON (a few MB a step; 53 ms of json.dumps for 256 trajectories on a
    # 2-core CPU, benchmarks/results/runner/step_records_cpu.json) in a worker thread: on the loop it would
    # hold every agent's answer behind it (host/loop_monitor.py names such holders); the file is the step's own
    await asyncio.to_thread(write_trajectories, ctx, step, handoff)
    # outside the step's clock, which ended before it
    metrics = {**metrics, **reads, "time/bookkeeping_overlapped": time.monotonic() - start_s}
    row = step_row(ctx, handoff, metrics, step_s)
    if validation is None:
        log_step(ctx, step, row)
    else:
        validation.metrics = row


def log_step(ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
    warn_on_search_errors(ctx, step, metrics)
    ctx.logger.log(step, metrics)


def mark_first_step(ctx: RunContext, phase: str) -> None:
    """A phase of the run's first step on the start-up timeline (later steps mark nothing)."""
    if not ctx.is_first_step_done:
        from tandemrl.host.startup import mark

        mark(f"step {ctx.start_step + 1} {phase}")


def report_startup(ctx: RunContext) -> None:
    """Print the start-up timeline and write startup.json (`tandem train` runs; host/startup.py)."""
    from tandemrl.host.startup import log_path, report

    path = log_path()
    if ctx.startup_origin is None or path is None:
        return
    origin_epoch, origin = ctx.startup_origin
    extra = {"time_to_first_step_s": None if math.isnan(ctx.first_step_s) else ctx.first_step_s}
    report(path, ctx.output_dir, origin_epoch, origin, extra)
