"""The generated knowledge base: a fictional "wiki" corpus with single- and two-hop questions.

`generate_kb(out_dir, seed)` writes
  corpus.jsonl          wiki-18 format {"id", "contents": "\"Title\"\ntext"}, one passage per fact
  train/val/test.jsonl  Search-R1 format {"id", "question", "golden_answers", "data_source",
                        "gold_passage_ids", "gold_queries", "hop_answers"} (data_source kb_1hop | kb_2hop)
  demos.jsonl           one Search-R1 trajectory plan per training question (see demos.py)
  kb_meta.json          sizes and the generation arguments
Invariant: the same (seed, num_entities, sizes) give byte-identical files — one seeded
`random.Random` per purpose, consumed in a fixed order, and no iteration over hash-ordered sets.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

from tandemrl.data.demos import plan_demo
from tandemrl.data.kb_entities import Entity, build_world
from tandemrl.data.kb_questions import Hop, build_questions, hop_words
from tandemrl.data.kb_templates import FILLERS, PASSAGES, fact_key

log = logging.getLogger(__name__)

SPLIT_FILES = ("train.jsonl", "val.jsonl", "test.jsonl")
# bump when the generated text changes, so that `tandem prepare all` regenerates an older default KB
KB_VERSION = 2


def passage_text(world: dict[str, Entity], entity: Entity, relation: str, rng: random.Random) -> str:
    """One fact in one of its templates, with a fact-free filler sentence for variety."""
    words = hop_words(world, Hop(entity.entity_id, relation, ""))
    words["value_long"] = words["value"]
    if relation == "country":  # sometimes the long form: "the Kingdom of Veltaria" (contains the name)
        country = world[str(entity.facts["country"])]
        words["value_long"] = rng.choice([country.name, f"the {country.aliases[0]}"])
    words["filler"] = rng.choice(FILLERS[entity.kind]).format(**words)
    return rng.choice(PASSAGES[fact_key(entity.kind, relation)]).format(**words)


def build_corpus(
    world: dict[str, Entity], rng: random.Random
) -> tuple[list[dict], dict[tuple[str, str], str]]:
    """Passages in world order, and the passage id of every (entity id, relation) fact."""
    passages, fact_passage = [], {}
    for entity in world.values():
        for relation in entity.facts:
            passage_id = str(len(passages))
            text = passage_text(world, entity, relation, rng)
            passages.append({"id": passage_id, "contents": f'"{entity.name}"\n{text}'})
            fact_passage[(entity.entity_id, relation)] = passage_id
    return passages, fact_passage


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _question_record(split: str, index: int, hops: tuple[Hop, ...], rendered: dict) -> dict:
    return {
        "id": f"{split}-{index:05d}",
        "question": rendered["question"],
        "golden_answers": rendered["golden_answers"],
        "data_source": "kb_1hop" if len(hops) == 1 else "kb_2hop",
        "gold_passage_ids": [hop.passage_id for hop in hops],
        "gold_queries": rendered["gold_queries"],
        "hop_answers": rendered["hop_answers"],
    }


def generate_kb(
    out_dir: str | Path,
    seed: int = 0,
    num_entities: int = 5000,
    num_train: int = 20000,
    num_val: int = 500,
    num_test: int = 500,
    two_hop_fraction: float = 0.4,
) -> Path:
    """Generate the knowledge base into `out_dir` (created if missing); returns `out_dir`."""
    if not 0.0 <= two_hop_fraction <= 1.0:
        raise ValueError(f"two_hop_fraction={two_hop_fraction} must be in [0, 1].")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = build_world(seed, num_entities)
    passages, fact_passage = build_corpus(world, random.Random(seed + 101))
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    splits = build_questions(world, fact_passage, random.Random(seed + 202), sizes, two_hop_fraction)
    _write_jsonl(out_dir / "corpus.jsonl", passages)
    demo_rng = random.Random(seed + 303)
    demos = []
    for split, chosen in splits.items():
        records = [_question_record(split, i, hops, rendered) for i, (hops, rendered) in enumerate(chosen)]
        _write_jsonl(out_dir / f"{split}.jsonl", records)
        if split == "train":
            demos = [
                plan_demo(world, record, hops, demo_rng)
                for record, (hops, _) in zip(records, chosen, strict=True)
            ]
    _write_jsonl(out_dir / "demos.jsonl", demos)
    meta = {
        "kb_version": KB_VERSION,
        "seed": seed,
        "num_entities": num_entities,
        "two_hop_fraction": two_hop_fraction,
        "num_passages": len(passages),
        "num_questions": {split: len(chosen) for split, chosen in splits.items()},
        "num_demos": len(demos),
    }
    (out_dir / "kb_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log.info("knowledge base in %s: %d passages, questions %s", out_dir, len(passages), meta["num_questions"])
    return out_dir


def kb_is_complete(kb_dir: str | Path) -> bool:
    """Whether a KB of this generator version is present (the meta file is written last)."""
    kb_dir = Path(kb_dir)
    names = ("corpus.jsonl", *SPLIT_FILES, "demos.jsonl", "kb_meta.json")
    if not all((kb_dir / name).is_file() for name in names):
        return False
    return json.loads((kb_dir / "kb_meta.json").read_text()).get("kb_version") == KB_VERSION
