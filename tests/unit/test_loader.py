"""PromptLoader: per-epoch seeded shuffle, exact position save/restore, stable ids, file formats."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tandemrl.data.loader import Prompt, PromptLoader, load_prompts


def write_jsonl(path: Path, num: int, prefix: str = "q") -> Path:
    with open(path, "w") as f:
        for i in range(num):
            f.write(
                json.dumps(
                    {
                        "id": f"{prefix}{i}",
                        "question": f"{prefix} question {i}?",
                        "golden_answers": [f"answer {i}"],
                        "data_source": "kb_1hop",
                    }
                )
                + "\n"
            )
    return path


def write_searchr1_parquet(path: Path, num: int) -> Path:
    """Search-R1's own layout: the question inside the instruction prompt, answers in reward_model."""
    rows = [
        {
            "data_source": "nq",
            "prompt": [
                {"role": "user", "content": f"Answer the given question. ... Question: who is {i}?\n"}
            ],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [f"person {i}", f"p{i}"]}},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(num)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def files(tmp_path) -> list[Path]:
    return [write_jsonl(tmp_path / "a.jsonl", 7, "a"), write_jsonl(tmp_path / "b.jsonl", 5, "b")]


def ids(prompts: list[Prompt]) -> list[str]:
    return [p.prompt_id for p in prompts]


def test_each_epoch_is_a_permutation_with_its_own_order(files):
    loader = PromptLoader(files, seed=3)
    epoch0, epoch1 = ids(loader.next_prompts(12)), ids(loader.next_prompts(12))
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 12
    assert epoch0 != epoch1
    assert loader.position == (1, 12)
    loader.next_prompts(1)
    assert loader.position == (2, 1) and loader.num_issued == 25


def test_same_seed_same_order_other_seed_other_order(files):
    first = ids(PromptLoader(files, seed=3).next_prompts(30))
    assert first == ids(PromptLoader(files, seed=3).next_prompts(30))
    assert first != ids(PromptLoader(files, seed=4).next_prompts(30))


def test_without_shuffle_the_order_is_file_order(files):
    loader = PromptLoader(files, seed=0, shuffle=False)
    assert ids(loader.next_prompts(13)) == [f"a:a{i}" for i in range(7)] + [f"b:b{i}" for i in range(5)] + [
        "a:a0"
    ]


def test_restore_continues_exactly(files):
    reference = PromptLoader(files, seed=9)
    expected = ids(reference.next_prompts(40))
    interrupted = PromptLoader(files, seed=9)
    interrupted.next_prompts(17)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives serialisation
    resumed = PromptLoader(files, seed=9)
    resumed.load_state_dict(state)
    assert resumed.position == (1, 5)
    assert ids(resumed.next_prompts(23)) == expected[17:]


def test_restore_at_an_epoch_boundary(files):
    loader = PromptLoader(files, seed=2)
    expected = ids(loader.next_prompts(24))
    partial = PromptLoader(files, seed=2)
    partial.next_prompts(12)
    resumed = PromptLoader(files, seed=2)
    resumed.load_state_dict(partial.state_dict())
    assert ids(resumed.next_prompts(12)) == expected[12:]


def test_restore_with_other_data_or_seed_is_refused(files, tmp_path):
    state = PromptLoader(files, seed=1).state_dict()
    with pytest.raises(ValueError, match="same data.train_data_paths"):
        PromptLoader(files[:1], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="data.seed"):
        PromptLoader(files, seed=2).load_state_dict(state)


def test_prompt_fields_and_unique_ids_across_same_stem_files(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    paths = [write_jsonl(tmp_path / "x" / "train.jsonl", 2), write_jsonl(tmp_path / "y" / "train.jsonl", 2)]
    prompts = load_prompts(paths)
    assert ids(prompts) == ["x/train:q0", "x/train:q1", "y/train:q0", "y/train:q1"]
    assert prompts[1] == Prompt("x/train:q1", "q question 1?", ["answer 1"], "kb_1hop")


def test_duplicate_record_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", 2)
    with pytest.raises(ValueError, match="duplicate prompt id"):
        load_prompts([path, path])


def test_reads_searchr1_parquet_and_jsonl_together(tmp_path):
    paths = [write_searchr1_parquet(tmp_path / "nq_train.parquet", 3), write_jsonl(tmp_path / "kb.jsonl", 2)]
    prompts = load_prompts(paths)
    assert prompts[0] == Prompt("nq_train:0", "who is 0?", ["person 0", "p0"], "nq")
    assert ids(prompts)[3:] == ["kb:q0", "kb:q1"]


def test_reads_a_json_array_file(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([{"id": 7, "question": "q?", "golden_answers": "a"}]))
    assert load_prompts([path]) == [Prompt("dev:7", "q?", ["a"], "dev")]


def test_missing_file_and_empty_paths_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts([tmp_path / "nope.jsonl"])
    with pytest.raises(ValueError, match="data.train_data_paths"):
        PromptLoader([], seed=0)
    bad = tmp_path / "bad.csv"
    bad.write_text("x\n")
    with pytest.raises(ValueError, match="unsupported suffix"):
        load_prompts([bad])


def test_record_without_answers_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": "1", "question": "q?"}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_prompts([path])
