"""What a runner works with, and the pieces of a step both runners share: wait for a hand-off, train on
it, sync weights under `rollout.pause_mode`, validate, record the prompt ledger, checkpoint.

Invariant: `ctx.weight_version` is the version in the engines and the one the next hand-off is
measured against (docs/DESIGN.md, Weight sync); it moves only in `sync_weights`, after the engines hold the new weights.
Step-time breakdown, every step: time/wait_data (the actor waiting for a hand-off), time/train,
time/sync_weights (= its pause + push + continue parts), and, for embedded engines, the engines' busy
fraction over the step window (from their cumulative `busy_s`); `metrics/logger.py` names the bottleneck.

The clock is the wall clock (docs/DESIGN.md, The step clock): `time/step` runs from the end of one step to
the end of the next, validation and checkpoints included (`time/validation`, `time/checkpoint` say how
much of it they took), so the steps' times add up to the run's wall time from the first step's start
(`time/wall`, cumulative). Both runners keep generating training rollouts while they validate.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandemrl.buffer.rollout_buffer import HandOff
from tandemrl.runner.records import write_ledger, write_trajectories
from tandemrl.runner.rollout_driver import RolloutDriver

if TYPE_CHECKING:
    from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

BUSY_KEYS = (  # cumulative, in /get_server_info
    "busy_s",
    "prefill_busy_s",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_steps",
    "num_prefill_steps",
    "num_decode_rows",
    "num_decode_emitted_tokens",
    "num_spec_draft_tokens",
    "num_spec_accepted_tokens",
)


@dataclass
class RunContext:
    config: TandemConfig
    driver: RolloutDriver
    actor: Any  # tandemrl.cluster.actor_group.ActorGroup
    engines: list[Any]  # EngineClient per engine
    logger: Any  # tandemrl.metrics.logger.MetricsLogger
    output_dir: Path
    weight_version: int
    start_step: int = 0
    val_prompts: list[Any] = field(default_factory=list)
    last_step_end_s: float = field(default_factory=time.monotonic)
    clock_start_s: float | None = None  # monotonic start of the first step (`start_clock`)
    busy_mark: tuple[float, dict[str, float]] | None = None  # (monotonic time, engines' BUSY_KEYS totals)
    started_s: float | None = None  # monotonic time of the process start (`tandem train`)
    first_step_s: float = float("nan")  # process start -> end of the run's first step
    placed_nodes: dict[str, str] = field(default_factory=dict)  # process -> the Ray node id it runs on
    startup_origin: tuple[float, str] | None = None  # (epoch, what it is): the start-up timeline's clock
    is_first_step_done: bool = False
    colocated_policy: str = "concurrent"  # the plan's: time_share stands the engines down while training

    @property
    def ledger_path(self) -> Path:
        return self.output_dir / "prompts.jsonl"


async def wait_for_data(ctx: RunContext, pause_admission: bool = False) -> tuple[HandOff, dict[str, float]]:
    """The next hand-off, and how long the actor waited for it (`time/wait_data`)."""
    start_s = time.monotonic()
    handoff = await ctx.driver.next_handoff(ctx.weight_version, pause_admission=pause_admission)
    mark_first_step(ctx, "generation done (hand-off taken)")
    return handoff, {"time/wait_data": time.monotonic() - start_s}


async def engine_busy_fraction(ctx: RunContext) -> dict[str, float]:
    """`rollout/engine_busy_fraction`: the engines' busy seconds since the last read over (engines x wall
    seconds), and the tokens they prefilled and decoded meanwhile (`rollout/engine_prefill_tokens`,
    `rollout/engine_decode_tokens`: prefill beyond the prompts and tool outputs is KV recomputed after a
    retract or a flushed prefix cache); empty on the first read and for external engines, which report
    no `busy_s`."""
    if ctx.config.rollout.backend != "embedded" or not ctx.engines:
        return {}
    infos = await asyncio.gather(*(engine.server_info() for engine in ctx.engines))
    now_s = time.monotonic()
    totals = {key: sum(float(info.get(key, 0)) for info in infos) for key in BUSY_KEYS}
    previous, ctx.busy_mark = ctx.busy_mark, (now_s, totals)
    if previous is None or now_s <= previous[0]:
        return {}
    delta = {key: totals[key] - previous[1][key] for key in BUSY_KEYS}
    fraction = delta["busy_s"] / (len(ctx.engines) * (now_s - previous[0]))
    metrics = {
        "rollout/engine_busy_fraction": min(1.0, fraction),
        "rollout/engine_prefill_tokens": delta["num_prefill_tokens"],
        "rollout/engine_decode_tokens": delta["num_decode_tokens"],
    }
    return {**metrics, **engine_step_metrics(delta)}


def engine_step_metrics(delta: dict[str, float]) -> dict[str, float]:
    """Where the engines' busy time went over a step window (deltas of BUSY_KEYS): how many steps of each
    kind, the mean decode batch, and the mean wall time of a step of each kind (an overlapped step's time
    also holds the postprocessing of the step before it). Engines that report no step counters give none."""
    if delta.get("num_steps", 0) <= 0:
        return {}
    num_prefill = delta.get("num_prefill_steps", 0.0)
    num_decode = delta["num_steps"] - num_prefill
    prefill_s = delta.get("prefill_busy_s", 0.0)
    metrics = {"rollout/engine_steps": delta["num_steps"], "rollout/engine_prefill_steps": num_prefill}
    if num_decode > 0:
        metrics["rollout/engine_decode_batch_mean"] = delta.get("num_decode_rows", 0.0) / num_decode
        metrics["rollout/engine_decode_step_ms"] = 1000 * (delta["busy_s"] - prefill_s) / num_decode
    if num_prefill > 0:
        metrics["rollout/engine_prefill_step_ms"] = 1000 * prefill_s / num_prefill
    return {**metrics, **spec_metrics(delta)}


def spec_metrics(delta: dict[str, float]) -> dict[str, float]:
    """Speculative decoding over a step window (engine/speculative.py): the share of draft tokens accepted,
    and the tokens a request's decode (verify) step emits on average, 1 without speculation; the decode
    steps per trajectory come in `end_of_step`, where the trajectories are counted."""
    num_rows = delta.get("num_decode_rows", 0.0)
    num_emitted = delta.get("num_decode_emitted_tokens", 0.0)
    if num_rows <= 0 or num_emitted <= 0:
        return {}
    metrics = {"rollout/spec/tokens_per_step": num_emitted / num_rows, "rollout/engine_decode_rows": num_rows}
    num_draft = delta.get("num_spec_draft_tokens", 0.0)
    if num_draft > 0:
        metrics["rollout/spec/acceptance_rate"] = delta.get("num_spec_accepted_tokens", 0.0) / num_draft
    return metrics


async def engine_counters(ctx: RunContext) -> dict[str, float] | None:
    """The embedded engines' cumulative step and token counters, summed (None for other backends, which
    report none): read around a train step, they say what the engines ran while the actor trained."""
    if ctx.config.rollout.backend != "embedded" or not ctx.engines:
        return None
    infos = await asyncio.gather(*(engine.server_info() for engine in ctx.engines))
    keys = ("num_steps", "num_prefill_tokens", "num_decode_tokens")
    return {key: float(sum(info.get(key, 0) for info in infos)) for key in keys}


async def train_on(ctx: RunContext, handoff: HandOff, step: int) -> dict[str, float]:
    """One actor train step on the hand-off; also `rollout/engine_steps_during_train` (and the tokens
    those steps prefilled and decoded) for embedded engines: 0 under time-sharing, by construction.
    A step in `runner.profile_steps` is recorded into <output_dir>/profiles/train_step_<step>.*."""
    from tandemrl.trainer.advantages import samples_from_trajectories

    samples = samples_from_trajectories(
        [g.trajectories for g in handoff.groups], norm_by_std=ctx.config.algorithm.norm_adv_by_std
    )
    args: list[Any] = [samples]
    if step in ctx.config.runner.profile_steps:
        args.append(str((ctx.output_dir / "profiles" / f"train_step_{step}").resolve()))
    before = await engine_counters(ctx)
    start_s = time.monotonic()
    metrics = dict(await ctx.actor.call("train_step", *args))
    metrics["time/train"] = time.monotonic() - start_s
    after = await engine_counters(ctx)
    if before is not None and after is not None:
        metrics["rollout/engine_steps_during_train"] = after["num_steps"] - before["num_steps"]
        for key in ("prefill", "decode"):
            counter = f"num_{key}_tokens"
            metrics[f"rollout/engine_{key}_tokens_during_train"] = after[counter] - before[counter]
    mark_first_step(ctx, "train done")
    return metrics


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
    """
    mode = ctx.config.rollout.pause_mode
    marks_s = [time.monotonic()]  # start, paused, pushed, continued
    was_paused = ctx.driver.is_paused  # the sync runner keeps admission closed until its next step
    if is_stood_down:
        assert mode != "drain", "time-sharing never stands down with drain (config/derive.py refuses it)"
    elif mode == "drain":
        ctx.driver.pause_admission()
        await ctx.driver.wait_idle()
    else:
        await asyncio.gather(*(engine.pause_generation(mode) for engine in ctx.engines))
    marks_s.append(time.monotonic())
    try:
        pushed = await ctx.actor.call("push_weights", weight_version)
        for engine in ctx.engines:  # the update boundary: tokens received from here on are the new version
            engine.mark_weight_version(weight_version)
    finally:
        marks_s.append(time.monotonic())
        if mode != "drain":
            await asyncio.gather(*(engine.continue_generation() for engine in ctx.engines))
    ctx.weight_version = weight_version
    ctx.driver.set_weight_version(weight_version)
    mark_first_step(ctx, "weight sync done")
    if mode == "drain" and not was_paused:
        ctx.driver.resume_admission()
    marks_s.append(time.monotonic())
    return {
        "time/sync_weights": marks_s[3] - marks_s[0],
        "time/sync_weights/pause": marks_s[1] - marks_s[0],
        "time/sync_weights/push": marks_s[2] - marks_s[1],
        "time/sync_weights/continue": marks_s[3] - marks_s[2],
        "sync_weights/bytes": float(pushed.get("sync_weights/bytes", 0.0)),
    }


def rollout_metrics(handoff: HandOff, step_s: float, norm_adv_by_std: bool = True) -> dict[str, float]:
    """The step's rollout metrics: the buffer's window figures, the trained trajectories' overall means
    and their means per data source (`per_source_metrics`)."""
    trajectories = [t for g in handoff.groups for t in g.trajectories]
    num = len(trajectories)
    response_length = sum(len(t.response_ids) for t in trajectories) / num
    metrics = dict(handoff.metrics)
    metrics.update(
        {
            "rollout/reward/mean": sum(float(t.reward) for t in trajectories) / num,
            "rollout/total_num_sequence": float(num),
            "rollout/response_length": response_length,
            "rollout/num_searches/mean": sum(len(getattr(t, "searches", [])) for t in trajectories) / num,
            "rollout/search_errors": float(sum(getattr(t, "num_search_errors", 0) for t in trajectories)),
            "time/step": step_s,
            "throughput": num * response_length / step_s if step_s > 0 else 0.0,
        }
    )
    metrics.update(per_source_metrics(handoff, norm_adv_by_std))
    metrics.update(trajectory_time_metrics(trajectories))
    return metrics


def trajectory_time_metrics(trajectories: list[Any]) -> dict[str, float]:
    """Where a trained trajectory's wall time went, mean seconds (`rollout/traj/*`): in all, waiting on the
    engine (`generate_s`; `server_s` of it inside the engine's server, so `generate_s - server_s` is HTTP
    and the client's own queuing), on searches, and the rest (the agent loop's host work)."""
    timed = [t for t in trajectories if getattr(t, "wall_s", 0.0) > 0]
    if not timed:
        return {}
    num = len(timed)
    means = {
        key: sum(getattr(t, key) for t in timed) / num
        for key in ("wall_s", "generate_s", "server_s", "search_s")
    }
    metrics = {f"rollout/traj/{key}": value for key, value in means.items()}
    if means["server_s"] > 0:
        metrics["rollout/traj/http_s"] = means["generate_s"] - means["server_s"]
    metrics["rollout/traj/agent_s"] = means["wall_s"] - means["generate_s"] - means["search_s"]
    return metrics


def per_source_metrics(handoff: HandOff, norm_adv_by_std: bool) -> dict[str, float]:
    """Per data source s of the trained groups (a group's trajectories share its prompt's source):
    - `rollout/reward/<s>`, `rollout/num_searches/<s>`: means over its trajectories;
    - `rollout/equal_reward_groups/<s>`: the fraction of its groups whose rewards are all equal, so
      their GRPO advantage is 0 and they teach nothing;
    - `rollout/search_advantage/<s>`: mean of advantage x searches over its trajectories, with the
      trainer's advantages. They sum to 0 within a group, so this is the within-group covariance of
      advantage and searches: > 0 pushes the policy toward more searches on s, < 0 toward fewer.
    """
    from tandemrl.agent.reward import reward_extra_means
    from tandemrl.buffer.group import has_equal_rewards
    from tandemrl.trainer.advantages import compute_grpo_advantages

    advantages = compute_grpo_advantages([g.rewards() for g in handoff.groups], norm_adv_by_std)
    by_source: dict[str, list[tuple[Any, list[float]]]] = {}
    for group, group_advantages in zip(handoff.groups, advantages, strict=True):
        by_source.setdefault(group.data_source, []).append((group, group_advantages))
    metrics = {}
    for source, entries in sorted(by_source.items()):
        pairs = [(t, a) for g, adv in entries for t, a in zip(g.trajectories, adv, strict=True)]
        num = len(pairs)
        metrics[f"rollout/reward/{source}"] = sum(float(t.reward) for t, _ in pairs) / num
        metrics[f"rollout/num_searches/{source}"] = sum(len(t.searches) for t, _ in pairs) / num
        metrics[f"rollout/equal_reward_groups/{source}"] = sum(
            has_equal_rewards(g.trajectories) for g, _ in entries
        ) / len(entries)
        metrics[f"rollout/search_advantage/{source}"] = sum(a * len(t.searches) for t, a in pairs) / num
        for name, value in reward_extra_means([t for t, _ in pairs]).items():  # reward.function's extras
            metrics[f"rollout/reward_extra/{name}/{source}"] = value
    return metrics


async def validate(ctx: RunContext) -> dict[str, float]:
    """Greedy EM and searches per trajectory on the validation prompts, per data source and overall
    (`val/em/<source>`, `val/em/all`, `val/num_searches/<source>`, `val/num_searches/all`)."""
    from tandemrl.agent.evaluate import OVERALL, evaluate_prompts, summarize

    if not ctx.val_prompts:
        return {}
    driver, num_engines = ctx.driver, len(ctx.engines)
    shards = [ctx.val_prompts[i::num_engines] for i in range(num_engines)]
    results = await asyncio.gather(
        *(
            evaluate_prompts(shard, engine, driver.search, driver.tokenizer, driver.agent_cfg)
            for shard, engine in zip(shards, ctx.engines, strict=True)
            if shard
        )
    )
    summary = summarize([traj for shard in results for traj in shard])
    metrics = {}
    for source, row in summary.items():
        name = "all" if source == OVERALL else source
        metrics[f"val/em/{name}"] = row["em"]
        metrics[f"val/num_searches/{name}"] = row["searches"]
    return metrics


async def validate_before_training(ctx: RunContext) -> None:
    """`runner.val_before_train`: the starting val EM, logged at the start step (0 on a fresh run)
    before any rollout, so the step clock (`start_clock`) starts after it."""
    if not (ctx.config.runner.val_before_train and ctx.val_prompts):
        return
    ctx.logger.log(ctx.start_step, await validate(ctx), advance=False)


def warn_on_search_errors(ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
    """Failed searches reach the agent as an error text and lower the reward silently: say so when a
    step's share of them passes tools.search.warn_error_fraction."""
    num_searches = metrics["rollout/num_searches/mean"] * metrics["rollout/total_num_sequence"]
    num_errors = metrics["rollout/search_errors"]
    threshold = ctx.config.tools.search.warn_error_fraction
    if num_errors and num_errors > threshold * max(num_searches, 1.0):
        log.warning(
            "step %d: %d of %d searches failed after retries (> tools.search.warn_error_fraction=%g); is "
            "the retrieval server at %s overloaded or down?",
            step,
            num_errors,
            num_searches,
            threshold,
            ctx.driver.search.url,
        )


def start_clock(ctx: RunContext) -> None:
    """The first step starts now: `time/wall` counts from here, and the first `time/step` too."""
    ctx.clock_start_s = ctx.last_step_end_s = time.monotonic()


async def end_of_step(ctx: RunContext, step: int, handoff: HandOff, metrics: dict[str, float]) -> None:
    """Everything after the weight sync: validation, ledger, checkpoint, then the step's metrics, whose
    `time/step` covers all of it (the time spent logging falls in the next step)."""
    from tandemrl.runner.checkpoint import save_checkpoint

    runner = ctx.config.runner
    metrics = dict(metrics)
    metrics.update(await engine_busy_fraction(ctx))
    metrics["rollout/weight_version"] = float(ctx.weight_version)
    if runner.val_interval and step % runner.val_interval == 0:
        start_s = time.monotonic()
        metrics.update(await validate(ctx))
        metrics["time/validation"] = time.monotonic() - start_s
    write_ledger(ctx, step)
    write_trajectories(ctx, step, handoff)
    if (runner.save_interval and step % runner.save_interval == 0) or step == runner.max_steps:
        start_s = time.monotonic()
        await save_checkpoint(ctx, step)
        metrics["time/checkpoint"] = time.monotonic() - start_s
    now_s = time.monotonic()
    if ctx.clock_start_s is None:  # a caller that never started the clock: its first step starts at creation
        ctx.clock_start_s = ctx.last_step_end_s
    metrics = {
        **rollout_metrics(handoff, now_s - ctx.last_step_end_s, ctx.config.algorithm.norm_adv_by_std),
        **metrics,
        "time/wall": now_s - ctx.clock_start_s,
    }
    ctx.last_step_end_s = now_s
    if "rollout/engine_decode_rows" in metrics and metrics.get("rollout/total_num_sequence"):
        # the window's decode rows (validation's included when it ran) over the hand-off's trajectories
        num_rows = metrics["rollout/engine_decode_rows"]
        metrics["rollout/spec/decode_steps_per_trajectory"] = num_rows / metrics["rollout/total_num_sequence"]
    warn_on_search_errors(ctx, step, metrics)
    ctx.logger.log(step, metrics)
    if step != ctx.start_step + 1:
        return
    mark_first_step(ctx, "done")
    ctx.is_first_step_done = True
    if ctx.started_s is not None:
        ctx.first_step_s = ctx.last_step_end_s - ctx.started_s
        log.info("time to first step: %.1f s (process start to the end of step %d)", ctx.first_step_s, step)
    report_startup(ctx)


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
