"""Converters: Search-R1's question parquet -> our jsonl; wiki-18 corpus read as is."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tandemrl.data.convert import convert_searchr1_parquet, iter_corpus, split_contents
from tandemrl.data.dataset import searchr1_question
from tandemrl.data.loader import load_prompts

PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. ... For example, <answer> Beijing </answer>. Question: "
)


def searchr1_rows() -> list[dict]:
    """Rows laid out as scripts/data_process/nq_search.py writes them (FlashRAG columns kept by .map)."""
    return [
        {
            "id": "train_0",
            "question": "who got the first nobel prize in physics",
            "golden_answers": ["Wilhelm Röntgen"],
            "data_source": "nq",
            "prompt": [{"role": "user", "content": PREFIX + "who got the first nobel prize in physics?\n"}],
            "ability": "fact-reasoning",
            "reward_model": {
                "style": "rule",
                "ground_truth": {"target": ["Wilhelm Conrad Röntgen", "Röntgen"]},
            },
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "id": "train_1",
            "question": "which band released Animals",
            "golden_answers": ["Pink Floyd"],
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": PREFIX + "which band released Animals?\n"}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Pink Floyd"]}},
            "extra_info": {"split": "train", "index": 1},
        },
    ]


def test_searchr1_parquet_converts_to_our_jsonl(tmp_path):
    src, dst = tmp_path / "nq_hotpotqa_train.parquet", tmp_path / "out" / "train.jsonl"
    pq.write_table(pa.Table.from_pylist(searchr1_rows()), src)
    assert convert_searchr1_parquet(src, dst) == 2
    records = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]
    assert records[0] == {
        "id": "train_0",
        "question": "who got the first nobel prize in physics",
        "golden_answers": ["Wilhelm Röntgen"],
        "data_source": "nq",
    }
    assert records[1]["data_source"] == "hotpotqa"
    assert [p.prompt_id for p in load_prompts([dst])] == ["train:train_0", "train:train_1"]


def test_prompt_only_layout_takes_question_from_prompt_and_answers_from_reward_model(tmp_path):
    rows = [
        {key: value for key, value in row.items() if key not in ("id", "question", "golden_answers")}
        for row in searchr1_rows()
    ]
    src, dst = tmp_path / "train.parquet", tmp_path / "train.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), src)
    convert_searchr1_parquet(src, dst, limit=1)
    (record,) = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]
    assert record == {
        "id": "0",
        "question": "who got the first nobel prize in physics?",
        "golden_answers": ["Wilhelm Conrad Röntgen", "Röntgen"],
        "data_source": "nq",
    }


def test_question_extraction_uses_the_last_question_marker():
    raw = {
        "prompt": [
            {"role": "system", "content": "Question: not this"},
            {"role": "user", "content": "Rules mention Question: words. Question: the real one?\n"},
        ]
    }
    assert searchr1_question(raw) == "the real one?"
    assert searchr1_question({"prompt": []}) is None


def test_iter_corpus_reads_wiki18_and_title_text_rows(tmp_path):
    path = tmp_path / "wiki-18.jsonl"
    rows = [
        {"id": "1", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": 2, "title": "Lyon", "text": "Lyon is a city."},
        {"title": "Nice", "text": "Nice is by the sea."},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    passages = list(iter_corpus(path))
    assert passages[0] == rows[0]
    assert passages[1] == {"id": "2", "contents": '"Lyon"\nLyon is a city.'}
    assert passages[2]["id"] == "2"  # no id: the line index
    assert split_contents(passages[1]["contents"]) == ("Lyon", "Lyon is a city.")


def test_iter_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tandem prepare kb"):
        list(iter_corpus(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "1", "body": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(iter_corpus(bad))
