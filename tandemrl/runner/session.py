"""One training run: build the parts around running services, resume if asked, run the sync or async
runner beside the engine watchdog, and take everything down again.

Invariant: whatever ends the run (the last step, an error, a dead server, Ctrl-C), the driver's tasks
are cancelled, the clients closed and the actor worker shut down before the services stop; a dead
engine or retrieval server ends the run with `ServiceDiedError` naming it within about one health
interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.buffer.rollout_buffer import BufferLimits, RolloutBuffer
from tandemrl.runner.context import RunContext
from tandemrl.runner.prompt_feed import PromptFeed
from tandemrl.runner.records import write_ledger
from tandemrl.runner.rollout_driver import RolloutDriver
from tandemrl.runner.services import ServiceDiedError, Services, model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandemrl.agent.tools import AgentEnv
    from tandemrl.cluster.actor_group import ActorGroup
    from tandemrl.config.schema import TandemConfig
    from tandemrl.data.loader import Prompt, PromptLoader
    from tandemrl.rollout.client import HttpClient

log = logging.getLogger(__name__)


def train_paths(config: TandemConfig, split: str) -> list[str]:
    from tandemrl.agent.evaluate import split_paths

    return split_paths(config.data, config.retrieval, split)


@dataclass
class PreparedSession:
    """What the driver needs that no service does, built while the services and the actor boot."""

    tokenizer: PreTrainedTokenizerBase
    loader: PromptLoader  # over the train split
    val_prompts: list[Prompt]


def _fitting_val_prompts(config: TandemConfig, tokenizer, prompts: list) -> list:
    """The validation prompts the engine can take with the response budget after them; the others are set
    aside with a warning, as `tandem eval` does (agent/evaluate.py `split_overlong`), not left to end the
    run at its first validation."""
    from tandemrl.agent.evaluate import prompt_room, split_overlong, warn_overlong

    room = prompt_room(config.rollout.max_context_len, config.agentloop)
    fitting, _, overlong = split_overlong(prompts, train_paths(config, "val"), tokenizer, room)
    warn_overlong(
        overlong, len(fitting), room, config.rollout.max_context_len, config.agentloop, "validation question"
    )
    return fitting


def prepare_session(config: TandemConfig) -> PreparedSession:
    """Load the tokenizer and the prompts, and import what the runner will (TensorBoard's writer, the
    clients, the agent loop), so none of it stands between the services' readiness and step 1."""
    from transformers import AutoTokenizer

    from tandemrl.data.loader import PromptLoader, load_prompts
    from tandemrl.host.startup import mark

    mark("driver: transformers imported")
    tokenizer = AutoTokenizer.from_pretrained(model_path(config))
    mark("driver: tokenizer loaded")
    data, runner = config.data, config.runner
    loader = PromptLoader(train_paths(config, "train"), seed=data.seed, shuffle=data.shuffle)
    val_prompts = (
        _fitting_val_prompts(config, tokenizer, load_prompts(train_paths(config, "val"), data.val_limit))
        if runner.val_interval or runner.val_before_train
        else []
    )
    mark("driver: prompts loaded")
    import torch.utils.tensorboard  # noqa: F401  the metrics logger's writer: seconds to import

    import tandemrl.agent.loop  # noqa: F401
    import tandemrl.agent.search_tool  # noqa: F401
    import tandemrl.rollout.client  # noqa: F401
    import tandemrl.runner.async_runner  # noqa: F401

    mark("driver: runner modules imported")
    return PreparedSession(tokenizer, loader, val_prompts)


def build_driver(
    config: TandemConfig,
    engines: list[HttpClient],
    search: AgentEnv,
    tokenizer: PreTrainedTokenizerBase,
    weight_version: int,
    resume_state: dict | None,
    loader: PromptLoader,
) -> RolloutDriver:
    from tandemrl.agent.evaluate import prompt_room
    from tandemrl.runner.checkpoint import resume_prompts

    feed = PromptFeed(
        loader,
        prefetch=config.data.rollout_batch_size,
        tokenizer=tokenizer,
        max_prompt_tokens=prompt_room(config.rollout.max_context_len, config.agentloop),
    )
    if resume_state is not None:
        loader.load_state_dict(resume_state["loader"])
        by_id = {prompt.prompt_id: prompt for prompt in loader.prompts}
        runner = config.runner
        feed.reissue(resume_prompts(resume_state, by_id, runner.reissue_on_resume, runner.resume_from))
    buffer = RolloutBuffer(buffer_limits(config)).task(config.agentloop.task_name or "default")
    return RolloutDriver(
        buffer,
        feed,
        engines,
        search,
        tokenizer,
        config.agentloop,
        config.algorithm.group_size,
        weight_version,
    )


async def run_session(
    config: TandemConfig,
    services: Services,
    actor: ActorGroup,
    started_s: float | None = None,
    prepared: PreparedSession | None = None,
    startup_origin: tuple[float, str] | None = None,
) -> RunContext:
    """Run the configured runner to `runner.max_steps`; returns its context (for tests and the demo).
    `started_s` (time.monotonic() of the process start) makes the first step log the time to reach it;
    `prepared`: `prepare_session`'s result, built while the services booted (else built here);
    `startup_origin` (epoch, what it is): the start-up timeline is reported after the first step."""
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.agent.tools import build_env
    from tandemrl.host.loop_monitor import LoopMonitor
    from tandemrl.host.startup import mark
    from tandemrl.metrics.logger import MetricsLogger
    from tandemrl.metrics.trackers import resolved_config
    from tandemrl.rollout.backends import make_client, pushes_atomically
    from tandemrl.runner.checkpoint import load_resume_state, restore_row

    runner, search_cfg = config.runner, config.tools.search
    output_dir = Path(runner.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    prepared = prepared or prepare_session(config)
    tokenizer = prepared.tokenizer
    engines = [
        make_client(
            config.rollout.backend,
            url,
            api_key=services.engine_api_key,
            max_context_len=config.rollout.max_context_len,
        )
        for url in services.engine_urls
    ]
    # the search tool, the plug-in tools and the reward: what the agent loops act in (agent/tools.py)
    search = build_env(
        config.agentloop,
        config.tools,
        config.reward,
        SearchTool.from_config(services.search_addr, search_cfg, services.search_api_key),
    )
    await actor.call(
        "connect_weight_sync",
        services.engine_urls,
        services.plan.weight_sync,
        config.rollout.sync_bucket_mb,
        config.rollout.backend,
        config.rollout.weight_sync_dir or str(output_dir.resolve() / "weight_sync"),
        services.engine_api_key,
        config.rollout.tensor_parallel_size,
        config.rollout.pause_mode,
    )
    mark("weight sync connected")
    start_step, resume_state = 0, None
    if runner.resume_from:
        resume_state = load_resume_state(runner.resume_from)
        await actor.call("load_checkpoint", runner.resume_from)
        start_step = int(resume_state["step"])
    weight_version = int(await actor.call("get_weight_version"))
    if weight_version > 0:  # the engines started from the base model: give them the resumed weights
        await actor.call("push_weights", weight_version)
    for engine in engines:  # the start of the update timeline that stamps streamed tokens
        engine.mark_weight_version(weight_version)
    driver = build_driver(config, engines, search, tokenizer, weight_version, resume_state, prepared.loader)
    val_prompts = prepared.val_prompts
    try:  # the trackers start here: one that cannot fails the run in one line (TrackerError)
        logger = MetricsLogger(
            output_dir,
            runner.max_steps,
            start_step=start_step,
            is_async=runner.async_mode,
            metrics_cfg=config.metrics,
            config=resolved_config(config),
        )
    except BaseException:
        await search.close()
        for engine in engines:
            await engine.close()
        raise
    if resume_state is not None:
        restore_row(logger, resume_state)
    ctx = RunContext(
        config, driver, actor, engines, logger, output_dir, weight_version, start_step, val_prompts
    )
    ctx.started_s = started_s
    ctx.startup_origin = startup_origin
    ctx.colocated_policy = services.plan.colocated_policy
    ctx.atomic_weight_updates = pushes_atomically(config.rollout.backend, services.plan.weight_sync)
    ctx.loop_monitor = LoopMonitor()
    ctx.loop_monitor.start()
    mark("runner starting")
    is_done = False
    try:
        await _run_with_watchdog(ctx, services)
        is_done = True
    finally:
        ctx.loop_monitor.stop()
        await driver.stop()
        try:
            if is_done and runner.weights_check_tokens:
                from tandemrl.runner.weights_check import check_weights

                await check_weights(ctx)
        finally:
            write_ledger(ctx, runner.max_steps)
            logger.close()
            await search.close()
            for engine in engines:
                await engine.close()
    return ctx


async def _run_with_watchdog(ctx: RunContext, services: Services) -> None:
    from tandemrl.runner.async_runner import run_async
    from tandemrl.runner.sync_runner import run_sync

    runner_fn = run_async if ctx.config.runner.async_mode else run_sync
    run_task = asyncio.create_task(runner_fn(ctx), name="runner")
    watchdog_task = asyncio.create_task(
        services.watchdog(ctx.engines, ctx.driver.search), name="services-watchdog"
    )
    try:
        await asyncio.wait([run_task, watchdog_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (run_task, watchdog_task):
            task.cancel()
        await asyncio.gather(run_task, watchdog_task, return_exceptions=True)
    if watchdog_task.done() and not watchdog_task.cancelled() and watchdog_task.exception() is not None:
        raise watchdog_task.exception()
    if not run_task.cancelled() and run_task.exception() is not None:
        await _blame_dead_engine(services, run_task.exception(), ctx.config.runner.engine_health_interval_s)
    run_task.result()


async def _blame_dead_engine(services: Services, error: BaseException, interval_s: float) -> None:
    """A failed request is often the first sign of a dead server: name the server rather than the
    request's connection error, giving the process up to one health interval to be seen as exited."""
    deadline = time.monotonic() + interval_s
    while True:
        try:
            await services.check()
        except ServiceDiedError as died:
            raise died from error
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.1)


def buffer_limits(config: TandemConfig) -> BufferLimits:
    """The buffer's limits from a derived config (concrete after `derive_and_validate`): the buffer
    takes these numbers only and imports nothing of config/."""
    buffer = config.rollout_buffer
    return BufferLimits(
        rollout_batch_size=config.data.rollout_batch_size,
        max_inflight_groups=buffer.max_inflight_groups,
        max_buffered_groups=buffer.max_buffered_groups,
        max_dropped_groups_per_step=buffer.max_dropped_groups_per_step,
        max_staleness=config.agentloop.max_actor_accept_staleness,
        reject_equal_reward=config.down_sampling.down_sampling_config.reject_equal_reward,
        max_head_offpolicyness=buffer.max_head_offpolicyness,
        handoff_order=buffer.handoff_order,
    )
