"""Questions over the knowledge base: single-hop (one fact) and two-hop bridge (a fact of a fact).

Invariant: a question never contains any of its accepted answers (normalised substring check), no two
questions share a text, and no fact used by a validation or test question is used by a training
question — so held-out answers cannot be memorised from training and must be searched for.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from tandemrl.data.kb_entities import Entity, normalize
from tandemrl.data.kb_templates import BRIDGES, FRAMES, QUERIES, article, fact_key, wording

log = logging.getLogger(__name__)

RELATIONS = (
    "born_in",
    "employer",
    "country",
    "capital",
    "founded_by",
    "led_by",
    "headquarters",
    "creator",
    "publisher",
)
# two-hop chains that would lead straight back to the question's entity
EXCLUDED_CHAINS = {("capital", "country")}


@dataclass(frozen=True)
class Hop:
    """One fact step: `entity` has `relation` = answer (an entity's name, or a scalar as text)."""

    entity_id: str
    relation: str
    passage_id: str


def fact_value(world: dict[str, Entity], entity: Entity, relation: str) -> str:
    value = entity.facts[relation]
    return world[value].name if relation in RELATIONS else str(value)


def fact_answers(world: dict[str, Entity], entity: Entity, relation: str) -> list[str]:
    """The accepted answers of a fact: the value's name first, then its aliases."""
    if relation in RELATIONS:
        target = world[str(entity.facts[relation])]
        return [target.name, *target.aliases]
    return [str(entity.facts[relation])]


def hop_words(world: dict[str, Entity], hop: Hop) -> dict[str, str]:
    """Every placeholder a template of this hop may use."""
    entity = world[hop.entity_id]
    value = fact_value(world, entity, hop.relation)
    words = wording(entity.detail)
    words.update(name=entity.name, value=value, article=article(value), article_genre=article(value))
    return words


def candidates(world: dict[str, Entity], fact_passage: dict[tuple[str, str], str]) -> tuple[list, list]:
    """All single-hop and two-hop question specs (lists of hops), in world order."""
    one_hop, two_hop = [], []
    for entity in world.values():
        for relation in entity.facts:
            first = Hop(entity.entity_id, relation, fact_passage[(entity.entity_id, relation)])
            one_hop.append((first,))
            if relation not in BRIDGES:
                continue
            target = world[str(entity.facts[relation])]
            for relation2 in target.facts:
                if (relation, relation2) in EXCLUDED_CHAINS:
                    continue
                second = Hop(target.entity_id, relation2, fact_passage[(target.entity_id, relation2)])
                two_hop.append((first, second))
    return one_hop, two_hop


def _contains_any(question: str, answers: list[str]) -> bool:
    norm_q = normalize(question)
    return any(normalize(answer) in norm_q for answer in answers)


def render_question(world: dict[str, Entity], hops: tuple[Hop, ...], rng: random.Random) -> dict | None:
    """Question text, answers and gold queries of a spec; None when no phrasing avoids the answer."""
    first = hops[0]
    first_words = hop_words(world, first)
    if len(hops) == 1:
        noun_phrase = first_words["name"]
    else:
        noun_phrase = rng.choice(BRIDGES[first.relation]).format(**first_words)
    last = hops[-1]
    last_entity = world[last.entity_id]
    frame_words = dict(wording(last_entity.detail), np=noun_phrase)
    key = fact_key(last_entity.kind, last.relation)
    answers = fact_answers(world, last_entity, last.relation)
    frames = FRAMES[key][:]
    rng.shuffle(frames)
    for frame in frames:
        question = frame.format(**frame_words)
        question = question[0].upper() + question[1:]
        if _contains_any(question, answers[:1]):
            continue
        kept = [answer for answer in answers if not _contains_any(question, [answer])]
        queries = [
            QUERIES[fact_key(world[h.entity_id].kind, h.relation)].format(**hop_words(world, h)) for h in hops
        ]
        return {
            "question": question,
            "golden_answers": kept,
            "gold_queries": queries,
            "hop_answers": [fact_value(world, world[h.entity_id], h.relation) for h in hops],
        }
    return None


def _take(world, pool, num, rng, seen_texts, blocked, counter) -> list[tuple[tuple[Hop, ...], dict]]:
    """The first `num` specs of `pool` that render validly and use no blocked fact."""
    taken = []
    for hops in pool:
        if len(taken) == num:
            break
        if any((h.entity_id, h.relation) in blocked for h in hops):
            continue
        rendered = render_question(world, hops, rng)
        if rendered is None or rendered["question"] in seen_texts:
            continue
        seen_texts.add(rendered["question"])
        counter.append(hops)
        taken.append((hops, rendered))
    return taken


def split_sizes(num_available: int, sizes: dict[str, int]) -> dict[str, int]:
    """Shrink the requested split sizes proportionally when the KB has fewer questions."""
    total = sum(sizes.values())
    if total <= num_available:
        return dict(sizes)
    scale = num_available / total
    log.warning(
        "the knowledge base supports ~%d questions, fewer than the %d requested: scaling splits by %.2f",
        num_available,
        total,
        scale,
    )
    return {split: max(1, int(size * scale)) for split, size in sizes.items()}


def build_questions(
    world: dict[str, Entity],
    fact_passage: dict[tuple[str, str], str],
    rng: random.Random,
    sizes: dict[str, int],
    two_hop_fraction: float,
) -> dict[str, list[tuple[tuple[Hop, ...], dict]]]:
    """Questions per split (held-out splits first, so training avoids their facts)."""
    one_hop, two_hop = candidates(world, fact_passage)
    rng.shuffle(one_hop)
    rng.shuffle(two_hop)
    # held-out facts remove a share of the training candidates; keep a margin for that
    sizes = split_sizes(int(0.8 * (len(one_hop) + len(two_hop))), sizes)
    seen_texts: set[str] = set()
    blocked: set[tuple[str, str]] = set()
    used_held_out: list[tuple[Hop, ...]] = []
    splits = {}
    for split in [name for name in sizes if name != "train"] + ["train"]:
        if split == "train":
            blocked = {(h.entity_id, h.relation) for hops in used_held_out for h in hops}
        num_two = round(sizes[split] * two_hop_fraction)
        counter = used_held_out if split != "train" else []
        chosen = _take(world, two_hop, num_two, rng, seen_texts, blocked, counter)
        chosen += _take(world, one_hop, sizes[split] - len(chosen), rng, seen_texts, blocked, counter)
        used = {hops for hops, _ in chosen}  # membership only; pool order stays the shuffled one
        one_hop = [hops for hops in one_hop if hops not in used]
        two_hop = [hops for hops in two_hop if hops not in used]
        rng.shuffle(chosen)
        splits[split] = chosen
    return splits
