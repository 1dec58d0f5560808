"""Cold-start demonstrations: a correct Search-R1 trajectory plan per training question (planned with the
KB, data/kb.py), rendered to token ids with the real retriever's results at SFT time (agent/demos.py).

A plan (one line of demos.jsonl) is
  {"id", "question", "golden_answers", "data_source",
   "steps": [{"think": str, "query": str, "entity": str, "expect": str}, ...],   # one search per hop
   "final_think": str, "answer": str}
and renders, exactly as the agent loop builds a trajectory, to
  prompt (mask 0) | <think> t1 </think>\n<search> q1 </search> (mask 1) | information block (mask 0)
  | ... | <think> final </think>\n<answer> a </answer><eos> (mask 1)
Invariant: model turns and tool text are tokenized separately and concatenated, as in the loop, and
the prompt and information blocks come from `tandemrl.agent.prompt`, so SFT sees the RL format.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.config.errors import ConfigError
from tandemrl.data.kb_templates import FOUND, NEEDS, fact_key

if TYPE_CHECKING:
    from tandemrl.data.kb_entities import Entity
    from tandemrl.data.kb_questions import Hop

FIRST_THINKS = [
    "I need to find {need}.",
    "To answer this, I must look up {need}.",
    "I do not know {need}, so I will search for it.",
    "The question asks for {need}. Let me search.",
]
BRIDGE_THINKS = [
    "First I need to find {need}.",
    "This takes two steps. First, I must find {need}.",
    "I should start by finding {need}.",
]
NEXT_THINKS = [
    "{found} Now I need to find {need}.",
    "{found} Next, I will look up {need}.",
    "{found} So I still need {need}.",
]
FINAL_THINKS = ["{found}", "{found} That answers the question.", "The information says: {found}"]


def plan_demo(world: dict[str, Entity], record: dict, hops: tuple[Hop, ...], rng: random.Random) -> dict:
    """The trajectory plan of one question: a think and a search per hop, then the answer."""
    from tandemrl.data.kb_questions import hop_words

    steps, found = [], ""
    for index, hop in enumerate(hops):
        words = hop_words(world, hop)
        key = fact_key(world[hop.entity_id].kind, hop.relation)
        need = NEEDS[key].format(**words)
        if index == 0:
            think = rng.choice(FIRST_THINKS if len(hops) == 1 else BRIDGE_THINKS).format(need=need)
        else:
            think = rng.choice(NEXT_THINKS).format(found=found, need=need)
        # half the queries are keyword style, half a plain phrase; both name entity and attribute
        query = record["gold_queries"][index] if rng.random() < 0.5 else need
        steps.append({"think": think, "query": query, "entity": words["name"], "expect": words["value"]})
        found = FOUND[key].format(**words)
    return {
        "id": record["id"],
        "question": record["question"],
        "golden_answers": record["golden_answers"],
        "data_source": record["data_source"],
        "steps": steps,
        "final_think": rng.choice(FINAL_THINKS).format(found=found),
        "answer": record["golden_answers"][0],
    }


def load_demos(
    path: str | Path,
    num_demos: int | None = None,
    seed: int = 0,
    per_source: dict[str, int] | None = None,
) -> list[dict]:
    """Demo plans from a demos.jsonl; `num_demos` picks a seeded random subset (the cold-start size knob,
    kept small so that RL still has room to improve). `per_source` ({data_source: count}) picks a seeded
    subset of each named source instead and leaves the others out; the result is shuffled.
    Every plan is checked (`plan_problem`) and an empty file refused, before any retrieval starts."""
    from tandemrl.host.files import InputFileError, is_missing, iter_json_lines  # bounded, lines named

    path = Path(path)
    if is_missing(path):
        raise FileNotFoundError(f"demonstrations file {path} does not exist; run `tandem prepare kb` first.")
    where = f"demonstrations file {str(path)!r}"
    numbered = list(iter_json_lines(path, "demonstrations file"))
    if not numbered:
        raise InputFileError(
            f"{where} is empty: it holds no demonstration. Run `tandem prepare kb` to write one, or point "
            "actor.sft.demos_path at a demos.jsonl with one plan per line."
        )
    for line_number, demo in numbered:
        problem = plan_problem(demo)
        if problem is not None:
            raise InputFileError(
                f"{where} line {line_number}: {problem}; each line must be a plan as `tandem prepare kb` "
                "writes it (data/demos.py)."
            )
    demos = [demo for _, demo in numbered]
    if per_source:
        return _per_source(demos, per_source, random.Random(seed), path)
    if num_demos is not None:
        if num_demos < 0:
            raise ConfigError(f"num_demos={num_demos} must be >= 0 (or None for all demonstrations).")
        demos = random.Random(seed).sample(demos, min(num_demos, len(demos)))
    return demos


PLAN_TEXTS = ("question", "final_think", "answer")  # what rendering reads (agent/demos.py), besides steps
STEP_TEXTS = ("think", "query", "entity", "expect")


def plan_problem(demo: dict) -> str | None:
    """What keeps one plan from rendering (a missing or mistyped field), or None."""
    steps = demo.get("steps")
    if not isinstance(steps, list):
        return _field_problem(demo, "steps", "a list of {think, query, entity, expect}")
    for index, step in enumerate(steps):
        if not isinstance(step, dict):
            return f"`steps[{index}]` is not an object with {', '.join(STEP_TEXTS)}"
        for key in STEP_TEXTS:
            if not isinstance(step.get(key), str):
                return _field_problem(step, key, "a string", f"steps[{index}].")
    for key in PLAN_TEXTS:
        if not isinstance(demo.get(key), str):
            return _field_problem(demo, key, "a string")
    if "data_source" in demo and not isinstance(demo["data_source"], str):
        return _field_problem(demo, "data_source", "a string")
    return None


def _field_problem(record: dict, key: str, expected: str, prefix: str = "") -> str:
    if key not in record:
        return f"missing `{prefix}{key}` ({expected})"
    return f"`{prefix}{key}` is {type(record[key]).__name__}, not {expected}"


def _per_source(demos: list[dict], per_source: dict[str, int], rng: random.Random, path: Path) -> list[dict]:
    by_source: dict[str, list[dict]] = {}
    for demo in demos:
        by_source.setdefault(demo.get("data_source", ""), []).append(demo)
    unknown = sorted(set(per_source) - set(by_source))
    if unknown:
        raise ConfigError(
            f"actor.sft.num_demos_per_source names data_source(s) {unknown} that {str(path)!r} does not "
            f"hold; its sources are {sorted(by_source)}."
        )
    picked = []
    for source in sorted(per_source):  # sorted: the subset does not depend on the mapping's order
        pool = by_source[source]
        count = per_source[source]
        if count < 0:
            raise ConfigError(f"actor.sft.num_demos_per_source.{source}={count} must be >= 0.")
        picked += rng.sample(pool, min(count, len(pool)))
    rng.shuffle(picked)
    return picked
