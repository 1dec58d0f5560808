"""`runner.weights_check_tokens` (0: off): after a run's last weight sync, each engine answers probe prompts
greedily, and the actor scores that output under the weights it pushed. The check passes when the actor
ranks every token the engine chose within `runner.weights_check_tie_nats` of its own top choice. With
the default of 1.0 nats, near-ties that two correct bf16 forwards break differently pass (0.2 nats at
most on CPU; vLLM on an H100 read 0.5 under a coarser bf16 measure); wrong weights put a token 6.8 nats
or more below on some probe and fail (trainer/greedy_gaps.py gives the measurements). `exact` says
whether the engine's output was the actor's greedy token for token; after a divergence `actor_argmax`
is the actor's choice on the engine's own prefix.

The result goes to `<output_dir>/weights_check.json`. A failure raises `WeightsCheckError` naming the
engine, the prompt, the position and the gap. It checks the sync end to end, for any backend: route,
names, dtypes, tied heads, the engine's own loading. Invariant: it runs with the rollout stopped, so
nothing else is batched with the probes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.runner.context import RunContext

log = logging.getLogger(__name__)

PROBES = [
    "The capital of France is",
    "Question: who wrote Hamlet?\nAnswer:",
    "1, 2, 3, 4,",
    "<search> the tallest mountain </search>",
]


class WeightsCheckError(RuntimeError):
    """An engine's greedy output differs from the actor's after a weight sync."""


async def check_weights(ctx: RunContext) -> dict:
    runner = ctx.config.runner
    prompts = [ctx.driver.tokenizer.encode(text) for text in PROBES]
    params = {"max_new_tokens": runner.weights_check_tokens, "temperature": 0.0, "ignore_eos": True}
    engines = []
    for engine in ctx.engines:
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        engines.append([r.output_ids for r in results])
    # one actor call for every engine: each call gathers the full weights and builds a model to score
    flat = await ctx.actor.call(
        "greedy_gaps", prompts * len(engines), [ids for out in engines for ids in out]
    )
    scored = [flat[e * len(prompts) : (e + 1) * len(prompts)] for e in range(len(engines))]
    report = judge(engines, scored, runner.weights_check_tie_nats)
    report.update(
        weight_version=ctx.weight_version,
        backend=ctx.config.rollout.backend,
        num_tokens=runner.weights_check_tokens,
        prompts=PROBES,
    )
    (ctx.output_dir / "weights_check.json").write_text(json.dumps(report, indent=2) + "\n")
    if not report["weights_check"]:
        raise WeightsCheckError(failure_message(report, ctx.output_dir / "weights_check.json"))
    log.info(
        "weights check passed: %d engine(s) x %d probes, %s",
        len(engines),
        len(prompts),
        "each the actor's greedy exactly"
        if report["exact"]
        else f"largest gap {report['max_gap_nats']:.3f} nats (a near-tie)",
    )
    return report


def judge(engines: list[list[list[int]]], scored: list[list[tuple[list[int], list[float]]]], tie_nats: float):
    """`engines[e][p]`: engine e's greedy ids for probe p; `scored[e][p]`: the actor's argmax and gaps over
    them (trainer/greedy_gaps.py). Every probe where the engine left the actor's argmax is a divergence;
    the check holds when no gap exceeds `tie_nats`."""
    divergences = []
    for e, (ids, actor) in enumerate(zip(engines, scored, strict=True)):
        for p, (engine_ids, (argmax, gaps)) in enumerate(zip(ids, actor, strict=True)):
            if engine_ids != argmax:
                worst = max(range(len(gaps)), key=gaps.__getitem__)
                divergences.append(
                    {
                        "engine": e,
                        "prompt": p,
                        "first_position": next(
                            i for i, (a, b) in enumerate(zip(engine_ids, argmax, strict=True)) if a != b
                        ),
                        "position": worst,
                        "max_gap_nats": gaps[worst],
                        "engine_ids": engine_ids,
                        "actor_argmax": argmax,
                        "gaps_nats": gaps,
                    }
                )
    max_gap = max((d["max_gap_nats"] for d in divergences), default=0.0)
    return {
        "weights_check": max_gap <= tie_nats,
        "exact": not divergences,
        "tie_nats": tie_nats,
        "max_gap_nats": max_gap,
        "engines": engines,
        "divergences": divergences,
    }


def failure_message(report: dict, path) -> str:
    """One line naming the first probe beyond the margin: engine, prompt, position, gap, the way out."""
    tie_nats = report["tie_nats"]
    failed = [d for d in report["divergences"] if d["max_gap_nats"] > tie_nats]
    first = failed[0]
    return (
        f"after the weight sync to version {report['weight_version']}, rollout engine {first['engine']} "
        f"({report['backend']}) answered {report['prompts'][first['prompt']]!r} greedily with "
        f"{first['engine_ids']}; at token {first['position']} the actor puts the engine's token "
        f"{first['max_gap_nats']:.2f} nats below its own top {first['actor_argmax'][first['position']]}, "
        f"beyond runner.weights_check_tie_nats={tie_nats}: the engine does not run the weights the actor "
        f"pushed ({len(failed)} probe(s); {path})"
    )
