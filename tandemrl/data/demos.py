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
    subset of each named source instead and leaves the others out; the result is shuffled."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"demonstrations file {path} does not exist; run `tandem prepare kb` first.")
    from tandemrl.host.files import iter_json_lines  # bounded, each bad line named (host/files.py)

    demos = [demo for _, demo in iter_json_lines(path, "demonstrations file")]
    if per_source:
        return _per_source(demos, per_source, random.Random(seed), path)
    if num_demos is not None:
        if num_demos < 0:
            raise ValueError(f"num_demos={num_demos} must be >= 0 (or None for all demonstrations).")
        demos = random.Random(seed).sample(demos, min(num_demos, len(demos)))
    return demos


def _per_source(demos: list[dict], per_source: dict[str, int], rng: random.Random, path: Path) -> list[dict]:
    by_source: dict[str, list[dict]] = {}
    for demo in demos:
        by_source.setdefault(demo.get("data_source", ""), []).append(demo)
    unknown = sorted(set(per_source) - set(by_source))
    if unknown:
        raise ValueError(
            f"num_demos_per_source names data_source(s) {unknown} that {path} does not hold; "
            f"its sources are {sorted(by_source)}."
        )
    picked = []
    for source in sorted(per_source):  # sorted: the subset does not depend on the mapping's order
        pool = by_source[source]
        count = per_source[source]
        if count < 0:
            raise ValueError(f"num_demos_per_source.{source}={count} must be >= 0.")
        picked += rng.sample(pool, min(count, len(pool)))
    rng.shuffle(picked)
    return picked
