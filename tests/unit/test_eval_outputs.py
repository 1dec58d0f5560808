"""`tandem eval`'s outputs: an --out (or the summary beside it) over a file the run reads is refused before
any service starts, and a question whose prompt does not fit the engine's context is set aside, named,
and listed in the summary, while the others are evaluated and written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandemrl.agent.loop import Trajectory
from tandemrl.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml")


def write_questions(path: Path, questions: list[str]) -> Path:
    records = [
        {"id": f"q{i}", "question": q, "golden_answers": ["x"], "data_source": "kb_1hop"}
        for i, q in enumerate(questions)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def questions(tmp_path) -> Path:
    return write_questions(tmp_path / "q" / "mine.jsonl", ["Who founded Amber Works?"])


@pytest.fixture
def no_services(monkeypatch):
    """Fails the test if `tandem eval` reaches its services (engines, retrieval server: other processes)."""

    def refuse(config):
        raise AssertionError("services started")

    monkeypatch.setattr("tandemrl.runner.services.Services", refuse)


def eval_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["eval", CONFIG, *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "relative with .."])
def test_out_over_the_question_file_is_refused_and_the_file_kept(
    tmp_path, capsys, no_services, questions, how
):
    before = questions.read_bytes()
    out = questions
    if how == "symlink":
        out = tmp_path / "link.jsonl"
        out.symlink_to(questions)
    elif how == "hard link":
        out = tmp_path / "hard.jsonl"
        os.link(questions, out)
    elif how == "relative with ..":
        out = questions.parent / ".." / "q" / questions.name
    code, err = eval_cli(
        capsys, "--split", "train", "--limit", "1", f"data.train_data_paths=[{questions}]", "--out", str(out)
    )
    assert code == 2
    assert "--out" in err and "data.train_data_paths" in err and len(err.strip().splitlines()) == 1
    assert questions.read_bytes() == before
    assert not (questions.parent / "train_summary.json").exists()


def test_out_over_a_question_file_of_another_split_is_refused(tmp_path, capsys, no_services, questions):
    other = write_questions(tmp_path / "val.jsonl", ["What?"])
    code, err = eval_cli(
        capsys,
        "--split",
        "train",
        f"data.train_data_paths=[{questions}]",
        f"data.val_data_paths=[{other}]",
        "--out",
        str(other),
    )
    assert code == 2 and "data.val_data_paths" in err
    assert json.loads(other.read_text())["question"] == "What?"


def test_summary_over_a_question_file_is_refused(tmp_path, capsys, no_services):
    # the summary goes to <split>_summary.json beside --out: here that is the question file itself
    questions = write_questions(tmp_path / "train_summary.json", ["Who?"])
    before = questions.read_bytes()
    code, err = eval_cli(
        capsys, "--split", "train", f"data.train_data_paths=[{questions}]", "--out", str(tmp_path / "t.jsonl")
    )
    assert code == 2 and "summary" in err and "data.train_data_paths" in err
    assert questions.read_bytes() == before


def test_out_named_like_the_summary_is_refused(tmp_path, capsys, no_services, questions):
    code, err = eval_cli(
        capsys,
        "--split",
        "train",
        f"data.train_data_paths=[{questions}]",
        "--out",
        str(tmp_path / "o" / "train_summary.json"),
    )
    assert code == 2 and "summary would replace the trajectories" in err


def test_summary_path_that_is_a_folder_is_refused_before_services(tmp_path, capsys, no_services, questions):
    (tmp_path / "o" / "train_summary.json").mkdir(parents=True)
    code, err = eval_cli(
        capsys,
        "--split",
        "train",
        f"data.train_data_paths=[{questions}]",
        "--out",
        str(tmp_path / "o" / "t.jsonl"),
    )
    assert code == 2 and "summary path" in err and "is a directory" in err


class FakeServices:
    """Stands in for runner/services.py's Services (the engine and retrieval server processes)."""

    engine_urls, search_addr, engine_api_key, search_api_key = ["http://engine"], "retrieval", None, None

    def __init__(self, config):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_overlong_question_is_set_aside_and_the_others_written(tmp_path, capsys, monkeypatch, smollm2_dir):
    path = write_questions(
        tmp_path / "qs.jsonl", ["Who founded Amber Works?", "word " * 5000, "Where is Holt?"]
    )
    seen = {}

    async def fake_evaluate(config, prompts, prompt_ids, urls, addr, tokenizer, keys):
        seen["ids"] = prompt_ids
        return [Trajectory(prompt_ids=ids, prompt_id=p.prompt_id, data_source=p.data_source)
                for p, ids in zip(prompts, prompt_ids, strict=True)]  # fmt: skip

    monkeypatch.setattr("tandemrl.runner.services.Services", FakeServices)
    monkeypatch.setattr("tandemrl.commands.evaluate._evaluate", fake_evaluate)
    out = tmp_path / "out" / "val.jsonl"
    code = main(["eval", CONFIG, "--split", "val", f"data.val_data_paths=[{path}]", "--out", str(out),
                 f"rollout.model.model_path={smollm2_dir}"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    written = [json.loads(line)["prompt_id"] for line in out.read_text().splitlines()]
    assert written == ["qs:q0", "qs:q2"]
    assert all(len(ids) <= 2048 - 640 for ids in seen["ids"])  # the prompts fit with the response budget
    skipped = json.loads((out.parent / "val_summary.json").read_text())["skipped_overlong"]
    assert skipped["max_prompt_tokens"] == 2048 - 640
    [question] = skipped["questions"]
    assert question["id"] == "qs:q1" and question["file"] == str(path) and question["prompt_tokens"] > 5000
    assert "1 skipped" in captured.out


def test_no_question_fits_is_refused_before_services(tmp_path, capsys, no_services, smollm2_dir):
    path = write_questions(tmp_path / "qs.jsonl", ["word " * 3000])
    code, err = eval_cli(capsys, "--split", "val", f"data.val_data_paths=[{path}]", "--out",
                         str(tmp_path / "o.jsonl"), f"rollout.model.model_path={smollm2_dir}")  # fmt: skip
    assert code == 2
    assert "qs:q0" in err and str(path) in err and "rollout.max_context_len=2048" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_split_overlong_keeps_file_order_and_names_each_file(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    from tandemrl.agent.evaluate import split_overlong
    from tandemrl.data.loader import load_prompts

    first = write_questions(tmp_path / "a" / "qs.jsonl", ["short", "word " * 300])
    second = write_questions(tmp_path / "b" / "qs.jsonl", ["word " * 300, "short too"])
    paths = [str(first), str(second)]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    fitting, ids, overlong = split_overlong(load_prompts(paths), paths, tokenizer, room=200)
    assert [p.question for p in fitting] == ["short", "short too"]
    assert [len(i) <= 200 for i in ids] == [True, True]
    assert [(o.prompt_id, o.path) for o in overlong] == [("a/qs:q1", str(first)), ("b/qs:q0", str(second))]
