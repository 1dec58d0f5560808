"""`runner.weights_check_tokens` (0: off): after a run's last weight sync, every engine's greedy output on
probe prompts must equal the actor's greedy output under the weights it pushed, token for token. The
result goes to `<output_dir>/weights_check.json`; a mismatch raises `WeightsCheckError` naming the
engine and the prompt. It checks the sync end to end (route, names, dtypes, tied heads, the engine's
own loading), for any backend. Invariant: it runs with the rollout stopped, so nothing else is batched
with the probes.
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
    num_tokens = ctx.config.runner.weights_check_tokens
    prompts = [ctx.driver.tokenizer.encode(text) for text in PROBES]
    actor = await ctx.actor.call("greedy", prompts, num_tokens)
    params = {"max_new_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True}
    engines = []
    for engine in ctx.engines:
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        engines.append([r.output_ids for r in results])
    mismatches = [
        {"engine": e, "prompt": PROBES[p], "actor": actor[p], "engine_ids": ids[p]}
        for e, ids in enumerate(engines)
        for p in range(len(prompts))
        if ids[p] != actor[p]
    ]
    report = {
        "weights_check": not mismatches,
        "weight_version": ctx.weight_version,
        "backend": ctx.config.rollout.backend,
        "num_tokens": num_tokens,
        "prompts": PROBES,
        "actor": actor,
        "engines": engines,
        "mismatches": mismatches,
    }
    (ctx.output_dir / "weights_check.json").write_text(json.dumps(report, indent=2) + "\n")
    if mismatches:
        first = mismatches[0]
        raise WeightsCheckError(
            f"after the weight sync to version {ctx.weight_version}, rollout engine {first['engine']} "
            f"({ctx.config.rollout.backend}) answered {first['prompt']!r} greedily with {first['engine_ids']} "
            f"where the actor gives {first['actor']} ({len(mismatches)} mismatch(es); "
            f"{ctx.output_dir / 'weights_check.json'})"
        )
    log.info(
        "weights check passed: %d engine(s) x %d probes equal the actor's greedy", len(engines), len(prompts)
    )
    return report
