"""The generated knowledge base: a fictional "wiki" corpus with single- and two-hop questions.

`generate_kb(out_dir, seed)` writes
  corpus.jsonl          wiki-18 format {"id", "contents": "\"Title\"\ntext"}, one passage per fact
  train/val/test.jsonl  Search-R1 format {"id", "question", "golden_answers", "data_source",
                        "gold_passage_ids", "gold_queries", "hop_answers"} (data_source kb_1hop | kb_2hop)
  demos.jsonl           one Search-R1 trajectory plan per training question (see demos.py)
  kb_meta.json          sizes and the generation arguments
Invariant: the same (seed, num_entities, sizes) give byte-identical files — one seeded
`random.Random` per purpose, consumed in a fixed order, and no iteration over hash-ordered sets.
Nothing else is replaced: `out_dir` must be new, empty, or an earlier KB of this generator (its
kb_meta.json and only the files above), the arguments are checked before anything is created, and the
files are written in a folder beside `out_dir` and moved in once all exist (kb_meta.json last), so an
interrupted run leaves the folder as it was.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

from tandemrl.data.demos import plan_demo
from tandemrl.data.kb_entities import Entity, build_world, check_num_entities
from tandemrl.data.kb_questions import Hop, build_questions, hop_words
from tandemrl.data.kb_templates import FILLERS, PASSAGES, fact_key

log = logging.getLogger(__name__)

SPLIT_FILES = ("train.jsonl", "val.jsonl", "test.jsonl")
KB_FILES = ("corpus.jsonl", *SPLIT_FILES, "demos.jsonl", "kb_meta.json")  # kb_meta.json last
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
    is_partial_ok: bool = False,
) -> Path:
    """Generate the knowledge base into `out_dir` (created if missing); returns `out_dir`. `is_partial_ok`:
    KB files without kb_meta.json (an interrupted older run) may be replaced too (the default KB's own
    folder under $TANDEM_HOME)."""
    if not 0.0 <= two_hop_fraction <= 1.0:
        raise ValueError(f"two_hop_fraction={two_hop_fraction} must be in [0, 1].")
    check_num_entities(num_entities)
    if not str(out_dir).strip():
        raise ValueError("the output folder is empty; name the folder to write the knowledge base to.")
    out_dir = Path(out_dir)
    check_kb_out(out_dir, is_partial_ok)
    world = build_world(seed, num_entities)
    passages, fact_passage = build_corpus(world, random.Random(seed + 101))
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    splits = build_questions(world, fact_passage, random.Random(seed + 202), sizes, two_hop_fraction)
    parent = Path(os.path.realpath(out_dir)).parent  # beside the folder itself, so that os.replace works
    parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name or 'kb'}.partial-", dir=parent))
    try:
        meta = _write_kb(stage, world, passages, splits, seed)
        meta["num_entities"], meta["two_hop_fraction"] = num_entities, two_hop_fraction
        (stage / "kb_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _move_in(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("knowledge base in %s: %d passages, questions %s", out_dir, len(passages), meta["num_questions"])
    return out_dir


def _write_kb(stage: Path, world, passages: list[dict], splits: dict, seed: int) -> dict:
    """Every file but kb_meta.json into `stage`; returns the meta without the generation arguments."""
    _write_jsonl(stage / "corpus.jsonl", passages)
    demo_rng = random.Random(seed + 303)
    demos = []
    for split, chosen in splits.items():
        records = [_question_record(split, i, hops, rendered) for i, (hops, rendered) in enumerate(chosen)]
        _write_jsonl(stage / f"{split}.jsonl", records)
        if split == "train":
            demos = [
                plan_demo(world, record, hops, demo_rng)
                for record, (hops, _) in zip(records, chosen, strict=True)
            ]
    _write_jsonl(stage / "demos.jsonl", demos)
    return {
        "kb_version": KB_VERSION,
        "seed": seed,
        "num_passages": len(passages),
        "num_questions": {split: len(chosen) for split, chosen in splits.items()},
        "num_demos": len(demos),
    }


def _move_in(stage: Path, out_dir: Path) -> None:
    """The staged files into `out_dir`; the old kb_meta.json goes first and the new one last, so that the
    folder reads as incomplete (`kb_is_complete`) while old and new files are mixed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kb_meta.json").unlink(missing_ok=True)
    for name in KB_FILES:
        os.replace(stage / name, out_dir / name)
        (out_dir / f"{name}.tmp").unlink(missing_ok=True)  # left by a run of an older version, interrupted


def check_kb_out(out_dir: Path, is_partial_ok: bool = False) -> None:
    """Refuse an output folder whose files are not an earlier KB of this generator (they would be replaced
    or mixed with the KB's): a folder must be new, empty, or hold kb_meta.json and only KB files."""
    where = f"the output folder {str(out_dir)!r}"
    try:
        if not out_dir.exists():
            existing = next(p for p in Path(os.path.abspath(out_dir)).parents if p.exists())
            if not existing.is_dir():
                raise ValueError(f"{where}: {str(existing)!r} is a file, so the folder cannot be made.")
            return
        if not out_dir.is_dir():
            raise ValueError(f"{where} is a file, not a folder; pass a new or empty folder.")
        names = sorted(entry.name for entry in os.scandir(out_dir))
    except OSError as error:
        raise ValueError(f"{where} cannot be read: {error.strerror}.") from None
    foreign = [name for name in names if name.removesuffix(".tmp") not in KB_FILES]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"{where} holds files that are not a knowledge base's ({shown}): they would be mixed with the "
            "KB's. Pass a new or empty folder, or one an earlier `tandem prepare kb` wrote."
        )
    if names and not is_partial_ok and not _is_kb_meta(out_dir / "kb_meta.json"):
        raise ValueError(
            f"{where} holds {', '.join(names)} but no kb_meta.json of `tandem prepare kb`: they are not "
            "known to be a generated KB and would be replaced. Pass a new or empty folder."
        )


def _is_kb_meta(path: Path) -> bool:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "kb_version" in meta and "num_passages" in meta


def kb_is_complete(kb_dir: str | Path) -> bool:
    """Whether a KB of this generator version is present (the meta file is written last)."""
    kb_dir = Path(kb_dir)
    if not all((kb_dir / name).is_file() for name in KB_FILES):
        return False
    return json.loads((kb_dir / "kb_meta.json").read_text()).get("kb_version") == KB_VERSION
