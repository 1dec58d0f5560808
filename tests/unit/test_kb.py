"""Knowledge-base generator: determinism, answerability from gold passages, held-out hygiene."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.data.convert import split_contents
from tandemrl.data.kb import generate_kb, kb_is_complete
from tandemrl.data.kb_entities import build_world, normalize

SMALL = {"num_entities": 400, "num_train": 1200, "num_val": 100, "num_test": 100}
FILES = ("corpus.jsonl", "train.jsonl", "val.jsonl", "test.jsonl", "demos.jsonl", "kb_meta.json")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def kb(tmp_path_factory) -> Path:
    return generate_kb(tmp_path_factory.mktemp("kb"), seed=3, **SMALL)


@pytest.fixture(scope="module")
def corpus(kb) -> dict[str, tuple[str, str]]:
    return {p["id"]: split_contents(p["contents"]) for p in read_jsonl(kb / "corpus.jsonl")}


@pytest.fixture(scope="module")
def splits(kb) -> dict[str, list[dict]]:
    return {split: read_jsonl(kb / f"{split}.jsonl") for split in ("train", "val", "test")}


def test_same_seed_gives_byte_identical_files(kb, tmp_path):
    again = generate_kb(tmp_path / "again", seed=3, **SMALL)
    for name in FILES:
        assert (kb / name).read_bytes() == (again / name).read_bytes(), name


def test_other_seed_gives_another_kb(kb, tmp_path):
    other = generate_kb(tmp_path / "other", seed=4, **SMALL)
    assert (kb / "corpus.jsonl").read_bytes() != (other / "corpus.jsonl").read_bytes()


def test_world_has_enough_entity_types_and_fact_kinds():
    world = build_world(seed=0, num_entities=400)
    kinds = {entity.kind for entity in world.values()}
    relations = {relation for entity in world.values() for relation in entity.facts}
    assert kinds == {"country", "city", "person", "org", "work"}
    assert len(relations) >= 8, relations
    names = [normalize(entity.name) for entity in world.values()]
    assert len(names) == len(set(names)), "entity names must be unique after normalisation"


def test_world_has_look_alike_names():
    world = build_world(seed=0, num_entities=400)
    people = [entity.name.split(" ", 1) for entity in world.values() if entity.kind == "person"]
    by_first: dict[str, list[str]] = {}
    for first, last in people:
        by_first.setdefault(first, []).append(last)
    look_alikes = [
        (a, b)
        for lasts in by_first.values()
        for a in lasts
        for b in lasts
        if a < b and a[:3] == b[:3] and abs(len(a) - len(b)) <= 2
    ]
    assert len(look_alikes) >= 5, look_alikes


def test_corpus_is_wiki18_format(kb):
    rows = read_jsonl(kb / "corpus.jsonl")
    assert len(rows) > 3 * SMALL["num_entities"]
    for row in rows:
        assert set(row) == {"id", "contents"} and isinstance(row["id"], str)
        assert row["contents"].startswith('"') and '"\n' in row["contents"]
    assert len({row["id"] for row in rows}) == len(rows)


def test_split_sizes_and_record_format(splits):
    assert [len(splits[s]) for s in ("train", "val", "test")] == [1200, 100, 100]
    for records in splits.values():
        assert {r["data_source"] for r in records} == {"kb_1hop", "kb_2hop"}
        for r in records:
            assert {
                "id",
                "question",
                "golden_answers",
                "data_source",
                "gold_passage_ids",
                "gold_queries",
            } <= set(r)
            assert r["golden_answers"] and all(isinstance(a, str) and a for a in r["golden_answers"])
            hops = 1 if r["data_source"] == "kb_1hop" else 2
            assert len(r["gold_passage_ids"]) == len(r["gold_queries"]) == hops


def test_single_hop_answer_is_in_a_passage_about_the_questions_entity(splits, corpus):
    checked = 0
    for records in splits.values():
        for r in (r for r in records if r["data_source"] == "kb_1hop"):
            title, text = corpus[r["gold_passage_ids"][0]]
            assert title in r["question"], (title, r["question"])
            assert r["golden_answers"][0] in text, (r, text)
            assert title in r["gold_queries"][0]
            checked += 1
    assert checked > 500


def test_two_hop_question_is_answered_by_chaining_two_passages(splits, corpus):
    checked = 0
    for records in splits.values():
        for r in (r for r in records if r["data_source"] == "kb_2hop"):
            (title1, text1), (title2, text2) = (corpus[pid] for pid in r["gold_passage_ids"])
            bridge, answer = r["hop_answers"]
            assert title1 in r["question"] and bridge in text1  # hop 1: the question's entity -> the bridge
            assert normalize(bridge) not in normalize(r["question"])  # the bridge must be searched for
            assert title2 == bridge and answer in text2  # hop 2: the bridge's own passage -> the answer
            assert answer == r["golden_answers"][0]
            assert title1 in r["gold_queries"][0] and bridge in r["gold_queries"][1]
            checked += 1
    assert checked > 300


def test_no_answer_appears_in_its_question(splits):
    for records in splits.values():
        for r in records:
            for answer in r["golden_answers"]:
                assert normalize(answer) not in normalize(r["question"]), (answer, r["question"])


def test_splits_are_disjoint_in_questions_ids_and_facts(splits):
    texts = {split: {r["question"] for r in records} for split, records in splits.items()}
    assert sum(len(t) for t in texts.values()) == sum(len(r) for r in splits.values())  # unique within splits
    assert not texts["train"] & texts["val"] and not texts["train"] & texts["test"]
    assert not texts["val"] & texts["test"]
    ids = [r["id"] for records in splits.values() for r in records]
    assert len(ids) == len(set(ids))
    # one passage per fact: no held-out fact is seen in training
    facts = {
        split: {pid for r in records for pid in r["gold_passage_ids"]} for split, records in splits.items()
    }
    assert not facts["train"] & (facts["val"] | facts["test"])


def test_country_answers_carry_their_long_form_alias(splits):
    aliased = [r for records in splits.values() for r in records if len(r["golden_answers"]) > 1]
    assert aliased
    for r in aliased:
        primary, *aliases = r["golden_answers"]
        assert all(primary in alias or alias in primary for alias in aliases), r


def test_demos_follow_the_gold_chain(kb, splits, corpus):
    demos = read_jsonl(kb / "demos.jsonl")
    train = splits["train"]
    assert [d["id"] for d in demos] == [r["id"] for r in train]
    for demo, record in zip(demos, train, strict=True):
        assert demo["answer"] == record["golden_answers"][0]
        assert [step["expect"] for step in demo["steps"]] == record["hop_answers"]
        for step, passage_id in zip(demo["steps"], record["gold_passage_ids"], strict=True):
            assert corpus[passage_id][0] in step["query"], step  # each search names its hop's entity
            assert step["think"]
        if len(demo["steps"]) == 2:  # the second think states what the first search found
            assert record["hop_answers"][0] in demo["steps"][1]["think"]
        assert record["hop_answers"][-1] in demo["final_think"]


def test_small_kb_scales_splits_down(tmp_path):
    out = generate_kb(tmp_path / "tiny", seed=0, num_entities=40, num_train=5000, num_val=50, num_test=50)
    meta = json.loads((out / "kb_meta.json").read_text())
    sizes = meta["num_questions"]
    assert sizes["train"] < 5000 and sizes["val"] >= 1 and sizes["test"] >= 1
    assert len(read_jsonl(out / "train.jsonl")) == sizes["train"]


def test_kb_is_complete_checks_files_and_generator_version(kb, tmp_path):
    assert kb_is_complete(kb)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in FILES:
        (copy / name).write_bytes((kb / name).read_bytes())
    meta = json.loads((copy / "kb_meta.json").read_text())
    (copy / "kb_meta.json").write_text(json.dumps({**meta, "kb_version": -1}))
    assert not kb_is_complete(copy)  # an older generator's KB is regenerated by `tandem prepare all`
    (kb / "demos.jsonl").rename(tmp_path / "demos.jsonl")
    try:
        assert not kb_is_complete(kb)
    finally:
        (tmp_path / "demos.jsonl").rename(kb / "demos.jsonl")


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_entities"):
        generate_kb(tmp_path / "x", num_entities=5)
    with pytest.raises(ValueError, match="two_hop_fraction"):
        generate_kb(tmp_path / "y", two_hop_fraction=1.5)


@pytest.mark.slow
def test_default_kb_size(tmp_path):
    out = generate_kb(tmp_path / "default", seed=0)
    meta = json.loads((out / "kb_meta.json").read_text())
    assert meta["num_questions"] == {"train": 20000, "val": 500, "test": 500}
    assert 18000 <= meta["num_passages"] <= 22000
    assert meta["num_demos"] == 20000
