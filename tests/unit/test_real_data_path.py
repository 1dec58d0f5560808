"""A researcher's own data in Search-R1's formats: the merged train parquet of scripts/data_process
(qa_search_train_merge.py, nq + hotpotqa), its gold answers, and a corpus in decomposed Unicode."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tandemrl.agent.reward import compute_reward
from tandemrl.data.loader import PromptLoader, load_prompts
from tandemrl.host.files import InputFileError
from tandemrl.retrieval import bm25

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. ... For example, <answer> Beijing </answer>. Question: {question}\n"
)


def searchr1_row(source: str, index: int, question: str, target: list, flashrag_id: bool = False) -> dict:
    """One row as Search-R1's make_map_fn writes it; `flashrag_id` keeps FlashRAG's own columns, which
    `datasets.map` leaves in place (`id` is "train_<n>", numbered per source)."""
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": INSTRUCTION.format(question=question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": target}},
        "extra_info": {"split": "train", "index": index},
    }
    if flashrag_id:
        row = {"id": f"train_{index}", "question": question, "golden_answers": target, **row}
    return row


def merged_train(path: Path, flashrag_id: bool = False) -> Path:
    """nq then hotpotqa, each numbered from 0, as qa_search_train_merge.py concatenates them."""
    rows = [
        searchr1_row(
            "nq", 0, "who wrote the song hotel california?", ["Don Felder", "Don Henley"], flashrag_id
        ),
        searchr1_row("nq", 1, "what is the capital of côte d'ivoire?", ["Yamoussoukro"], flashrag_id),
        searchr1_row("hotpotqa", 0, "Which band was formed first, Queen or U2?", ["Queen"], flashrag_id),
        searchr1_row("hotpotqa", 1, "Where is 東京タワー?", ["東京", "Tokyo, Japan"], flashrag_id),
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("flashrag_id", [False, True], ids=["extra_info_index", "flashrag_id"])
def test_merged_searchr1_train_parquet_loads_with_one_prompt_per_row(tmp_path, flashrag_id):
    path = merged_train(tmp_path / "train.parquet", flashrag_id)
    prompts = load_prompts([path])
    plain_id = "train_{}" if flashrag_id else "{}"
    assert [p.prompt_id for p in prompts] == [
        f"train:{source}/{plain_id.format(index)}" for source in ("nq", "hotpotqa") for index in (0, 1)
    ]
    assert [p.data_source for p in prompts] == ["nq", "nq", "hotpotqa", "hotpotqa"]
    assert prompts[3].question == "Where is 東京タワー?"
    assert prompts[3].golden_answers == ["東京", "Tokyo, Japan"]
    # the ids are read from the file alone: a second loader (a resumed run) finds the same prompts
    assert [p.prompt_id for p in PromptLoader([path], seed=0).prompts] == [p.prompt_id for p in prompts]


def test_a_file_whose_ids_are_all_unique_keeps_its_plain_ids(tmp_path):
    rows = [searchr1_row("nq", 0, "who?", ["a"]), searchr1_row("hotpotqa", 1, "what?", ["b"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert [p.prompt_id for p in load_prompts([tmp_path / "train.parquet"])] == ["train:0", "train:1"]


def test_a_repeated_index_within_one_source_is_still_refused(tmp_path):
    rows = [searchr1_row("nq", 0, "who?", ["a"]), searchr1_row("nq", 0, "what?", ["b"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with pytest.raises(InputFileError, match=r"duplicate prompt id 'train:0'.*extra_info\.index"):
        load_prompts([tmp_path / "train.parquet"])
    rows.append(searchr1_row("hotpotqa", 0, "where?", ["c"]))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with pytest.raises(InputFileError, match="duplicate prompt id 'train:nq/0'"):
        load_prompts([tmp_path / "train.parquet"])


def test_a_null_gold_answer_is_refused_not_read_as_the_answer_none(tmp_path):
    rows = [searchr1_row("nq", 0, "who?", ["Alice", None])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    with pytest.raises(
        InputFileError, match=r"row 1: `reward_model\.ground_truth\.target` is \['Alice', None\]"
    ):
        load_prompts([tmp_path / "test.parquet"])


def test_an_empty_target_list_is_named_by_its_searchr1_field(tmp_path):
    rows = [searchr1_row("nq", 0, "who?", ["a"]), searchr1_row("nq", 1, "who is nobody?", [])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    with pytest.raises(InputFileError, match=r"row 2: `reward_model\.ground_truth\.target` is empty"):
        load_prompts([tmp_path / "test.parquet"])


def test_every_gold_answer_of_a_parquet_row_scores_under_exact_match(tmp_path):
    prompt = load_prompts([merged_train(tmp_path / "train.parquet")])[3]
    for answer in ("東京", "tokyo japan", "Tokyo, Japan."):
        assert compute_reward(f"<answer> {answer} </answer>", prompt.golden_answers) == 1.0
    assert compute_reward("<answer> Kyoto </answer>", prompt.golden_answers) == 0.0


def test_bm25_matches_decomposed_text_against_a_composed_query():
    passage = unicodedata.normalize("NFD", "The capital of Côte d'Ivoire; São Paulo")
    assert bm25.tokenize(passage) == bm25.tokenize("The capital of Côte d'Ivoire; São Paulo")
    assert "côte" in bm25.tokenize(passage)


CPU_ASYNC = str(Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml")


def own_questions(tmp_path: Path) -> list[str]:
    """A model, an index and the user's own train file, outside the generated knowledge base."""
    (tmp_path / "model").mkdir()
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")  # what makes a directory an index
    pq.write_table(pa.Table.from_pylist([searchr1_row("nq", 0, "who?", ["a"])]), tmp_path / "train.parquet")
    return [
        f"rollout.model.model_path={tmp_path / 'model'}",
        f"retrieval.index_dir={tmp_path / 'index'}",
        f"data.train_data_paths=[{tmp_path / 'train.parquet'}]",
    ]


def test_validation_on_the_knowledge_base_beside_own_train_questions_is_refused(tmp_path, capsys):
    from tandemrl.cli import main

    base = ["config", "show", "--check", CPU_ASYNC, *own_questions(tmp_path)]
    assert main([*base, "runner.val_interval=5"]) == 2
    err = capsys.readouterr().err
    assert (
        "configuration error: data.val_data_paths is not set" in err and "generated knowledge base" in err
    ), err
    assert str(tmp_path / "train.parquet") in err and "runner.val_interval=0" in err
    pq.write_table(pa.Table.from_pylist([searchr1_row("nq", 0, "what?", ["b"])]), tmp_path / "val.parquet")
    assert main([*base, "runner.val_interval=5", f"data.val_data_paths=[{tmp_path / 'val.parquet'}]"]) == 0
    assert main(base) == 0, capsys.readouterr().err  # no validation: nothing falls back


def test_eval_of_the_knowledge_base_test_split_beside_own_questions_is_refused(tmp_path, capsys, monkeypatch):
    from tandemrl.cli import main

    def no_services(config):
        raise AssertionError("services started")

    monkeypatch.setattr("tandemrl.runner.services.Services", no_services)
    assert main(["eval", CPU_ASYNC, *own_questions(tmp_path), "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert "--split test" in err and "--split val data.val_data_paths=[FILE]" in err, err


def test_the_knowledge_base_own_train_file_still_leaves_validation_to_it(tmp_path, monkeypatch):
    from tandemrl.agent.evaluate import split_paths
    from tandemrl.config.errors import ConfigError
    from tandemrl.config.schema import DataConfig, RetrievalConfig
    from tandemrl.host.home import default_kb_dir

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    kb = default_kb_dir()
    kb.mkdir(parents=True)
    for split in ("train", "val"):
        (kb / f"{split}.jsonl").write_text('{"id": 1, "question": "a?", "golden_answers": ["b"]}\n')
    assert split_paths(DataConfig(train_data_paths=[str(kb / "train.jsonl")]), RetrievalConfig(), "val") == [
        str(kb / "val.jsonl")
    ]
    mine = DataConfig(train_data_paths=[str(tmp_path / "train.jsonl")])
    with pytest.raises(ConfigError, match="data.val_data_paths is not set"):
        split_paths(mine, RetrievalConfig(), "val")
    # a corpus the user names is their own layout: its val.jsonl is read
    corpus = RetrievalConfig(corpus_path=str(kb / "corpus.jsonl"))
    assert split_paths(mine, corpus, "val") == [str(kb / "val.jsonl")]
