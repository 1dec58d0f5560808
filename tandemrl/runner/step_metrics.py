"""A step's metrics from what it handed over and what the engines report: rewards, lengths, staleness and
per-source figures of the hand-off, trajectory times, and the embedded engines' busy fraction over the
step window (from their cumulative `busy_s` counters, read over HTTP). The rest are pure functions of
their inputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tandemrl.buffer.rollout_buffer import HandOff
from tandemrl.runner.context import RunContext

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
    "num_prefix_hit_tokens",
    "num_stale_prefix_hit_tokens",
    "num_prefill_graph_steps",
    "http_loop_late_s",
    "http_loop_stalled_s",
)


Mark = tuple[float, dict[str, float]]  # (monotonic time, cumulative counters read then)


def advance_window(
    previous: Mark | None, totals: dict[str, float]
) -> tuple[Mark, tuple[dict[str, float], float] | None]:
    """The new mark for cumulative counters read now, and the window since `previous`: each counter's
    delta and the window's seconds (None on the first read, or when no time passed)."""
    now_s = time.monotonic()
    mark = (now_s, totals)
    if previous is None or now_s <= previous[0]:
        return mark, None
    return mark, ({key: totals[key] - previous[1][key] for key in totals}, now_s - previous[0])


async def engine_busy_fraction(ctx: RunContext) -> dict[str, float]:
    """`rollout/engine_busy_fraction`: the engines' busy seconds since the last read over (engines x wall
    seconds), and the tokens they prefilled and decoded meanwhile (`rollout/engine_prefill_tokens`,
    `rollout/engine_decode_tokens`: prefill beyond the prompts and tool outputs is KV recomputed after a
    retract or a flushed prefix cache); empty on the first read and for external engines, which report
    no `busy_s`."""
    if ctx.config.rollout.backend != "embedded" or not ctx.engines:
        return {}
    infos = await asyncio.gather(*(engine.server_info() for engine in ctx.engines))
    totals = {key: sum(float(info.get(key, 0)) for info in infos) for key in BUSY_KEYS}
    ctx.busy_mark, window = advance_window(ctx.busy_mark, totals)
    if window is None:
        return {}
    delta, window_s = window
    fraction = delta["busy_s"] / (len(ctx.engines) * window_s)
    metrics = {
        "rollout/engine_busy_fraction": min(1.0, fraction),
        "rollout/engine_prefill_tokens": delta["num_prefill_tokens"],
        "rollout/engine_decode_tokens": delta["num_decode_tokens"],
        # prompt tokens the prefix cache served, and those of them from the previous weights' K/V
        # (rollout.engine.prefix_cache_max_age)
        "rollout/engine_prefix_hit_tokens": delta["num_prefix_hit_tokens"],
        "rollout/engine_stale_prefix_hit_tokens": delta["num_stale_prefix_hit_tokens"],
        # the engines' HTTP event loops, summed: their timer's lateness, and time held past 50 ms at a
        # stretch (host/loop_monitor.py); an answer waits behind whatever holds the loop
        "rollout/engine_http_loop_late_s": delta["http_loop_late_s"],
        "rollout/engine_http_loop_stalled_s": delta["http_loop_stalled_s"],
    }
    return {**metrics, **engine_step_metrics(delta)}


RETRIEVAL_KEYS = ("num_queries", "num_batches", "busy_s", "queue_wait_s")  # cumulative, in its /health


async def retrieval_load(ctx: RunContext) -> dict[str, float]:
    """The retrieval server's load over the step window, from the cumulative counters of tandem's server
    (retrieval/batcher.py): `retrieval/queries`, `retrieval/batch_queries_mean` (queries a batch served
    together), `retrieval/busy_fraction` (of the window its search thread worked), `retrieval/search_ms_per_batch`
    and `retrieval/queue_ms_per_query` (from a request's arrival to its batch's start). Empty on the first
    read and for a server without the counters (a Search-R1 server)."""
    info = await ctx.driver.search.server_info()
    if not all(isinstance(info.get(key), int | float) for key in RETRIEVAL_KEYS):
        return {}
    totals = {key: float(info[key]) for key in RETRIEVAL_KEYS}
    ctx.retrieval_mark, window = advance_window(ctx.retrieval_mark, totals)
    if window is None:
        return {}
    delta, window_s = window
    metrics = {
        "retrieval/queries": delta["num_queries"],
        "retrieval/busy_fraction": min(1.0, delta["busy_s"] / window_s),
    }
    if delta["num_batches"] > 0:
        metrics["retrieval/batch_queries_mean"] = delta["num_queries"] / delta["num_batches"]
        metrics["retrieval/search_ms_per_batch"] = 1000 * delta["busy_s"] / delta["num_batches"]
    if delta["num_queries"] > 0:
        metrics["retrieval/queue_ms_per_query"] = 1000 * delta["queue_wait_s"] / delta["num_queries"]
    return metrics


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
    if num_prefill > 0 and "num_prefill_graph_steps" in delta:  # of them replayed as CUDA graphs
        metrics["rollout/engine_prefill_graph_steps"] = delta["num_prefill_graph_steps"]
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


async def launched_spec_reads(ctx: RunContext) -> dict[str, float]:
    """`rollout/spec/*` for launched vLLM or SGLang servers that speculate (`rollout.engine.speculative`),
    from their cumulative counters over the step window: vLLM's Prometheus /metrics (`VllmClient.counters`),
    SGLang's per-request counts summed by our client (`EngineClient.counters`). Empty otherwise and on the
    first read."""
    if (
        ctx.config.rollout.backend not in ("vllm", "sglang")
        or ctx.config.rollout.engine.speculative == "none"
        or not ctx.engines
    ):
        return {}
    counters = await asyncio.gather(*(engine.counters() for engine in ctx.engines))
    totals = {key: sum(c[key] for c in counters) for key in counters[0]}
    ctx.launched_spec_mark, window = advance_window(ctx.launched_spec_mark, totals)
    return {} if window is None else spec_metrics(window[0])


async def engine_counters(ctx: RunContext) -> dict[str, float] | None:
    """The embedded engines' cumulative step and token counters, summed (None for other backends, which
    report none): read around a train step, they say what the engines ran while the actor trained."""
    if ctx.config.rollout.backend != "embedded" or not ctx.engines:
        return None
    infos = await asyncio.gather(*(engine.server_info() for engine in ctx.engines))
    keys = ("num_steps", "num_prefill_tokens", "num_decode_tokens")
    return {key: float(sum(info.get(key, 0) for info in infos)) for key in keys}


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
