"""Acceptance: a generated KB indexed into Qdrant, served by `tandem serve-retrieval` as a real process on
a free port, queried over HTTP (raw Search-R1 requests and the SearchTool client)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time

import pytest
import requests

from tandemrl.agent.search_tool import SearchError, SearchTool, format_documents
from tandemrl.data.kb import generate_kb
from tandemrl.retrieval.build import build_index
from tandemrl.retrieval.server_process import RetrievalServerProcess


@pytest.fixture(scope="module")
def kb(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("retrieval_kb")
    kb_dir = generate_kb(root / "kb", seed=0, num_entities=200)
    index_dir = root / "index"
    build_index(
        kb_dir / "corpus.jsonl", index_dir, encoder=str(minilm_dir), sparse="bm25", show_progress=False
    )
    corpus = {record["id"]: record["contents"] for record in map(json.loads, open(kb_dir / "corpus.jsonl"))}
    questions = []
    for split in ("train", "val", "test"):
        questions += [
            q for q in map(json.loads, open(kb_dir / f"{split}.jsonl")) if q["data_source"] == "kb_1hop"
        ]
    return {"index": root / "index", "corpus": corpus, "questions": questions}


@pytest.fixture(scope="module")
def server(kb):
    with RetrievalServerProcess(kb["index"], mode="hybrid") as server:
        yield server


def post(server, body) -> requests.Response:
    return requests.post(f"{server.url}/retrieve", json=body, timeout=30)


def test_health_reports_the_index(server, kb):
    health = requests.get(f"{server.url}/health", timeout=5).json()
    assert health["status"] == "ok" and health["mode"] == "hybrid" and health["fusion"] == "zscore"
    assert health["num_passages"] == len(kb["corpus"])


def test_expected_passage_comes_first(server, kb):
    rng = random.Random(0)
    # a passage's own text must come back first, for any passage
    sample = rng.sample(sorted(kb["corpus"]), 20)
    result = post(server, {"queries": [kb["corpus"][pid] for pid in sample], "topk": 3})
    assert [docs[0]["id"] for docs in result.json()["result"]] == sample
    # the gold query plus its answer (what an agent checking a fact searches) finds the gold passage first
    questions = rng.sample(kb["questions"], 40)
    queries = [f"{q['gold_queries'][0]} {q['golden_answers'][0]}" for q in questions]
    result = post(server, {"queries": queries, "topk": 3, "return_scores": True}).json()["result"]
    first = [
        docs[0]["document"]["id"] == q["gold_passage_ids"][0]
        for docs, q in zip(result, questions, strict=True)
    ]
    assert sum(first) >= 0.9 * len(questions), sum(first)
    # the bare gold query finds it within the top 3 (the documents the agent sees)
    result = post(server, {"queries": [q["gold_queries"][0] for q in questions], "topk": 3}).json()["result"]
    top3 = [
        q["gold_passage_ids"][0] in [d["id"] for d in docs] for docs, q in zip(result, questions, strict=True)
    ]
    assert sum(top3) >= 0.85 * len(questions), sum(top3)


def test_search_r1_client_request_and_parsing(server, kb):
    """Search-R1's generation code: `requests.post(search_url, json=payload).json()`, then
    `_passages2string` on each query's result."""
    question = kb["questions"][0]
    payload = {
        "queries": [question["gold_queries"][0], "an unrelated query"],
        "topk": 3,
        "return_scores": True,
    }
    results = requests.post(f"{server.url}/retrieve", json=payload).json()["result"]
    assert len(results) == 2
    for retrieval_result in results:
        format_reference = ""
        for idx, doc_item in enumerate(retrieval_result):
            content = doc_item["document"]["contents"]
            title = content.split("\n")[0]
            text = "\n".join(content.split("\n")[1:])
            format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
        assert format_reference == format_documents(retrieval_result)
        lines = format_reference.splitlines()
        assert len(lines) == 3 and all(
            line.startswith(f'Doc {i + 1}(Title: "') for i, line in enumerate(lines)
        )
        assert all(isinstance(doc_item["score"], float) for doc_item in retrieval_result)
    gold = kb["corpus"][question["gold_passage_ids"][0]]
    assert any(doc["document"]["contents"] == gold for doc in results[0])


def test_bad_requests_never_take_the_server_down(server):
    assert post(server, {"queries": "text"}).status_code == 422
    assert requests.post(f"{server.url}/retrieve", data=b"\xff\x00{", timeout=5).status_code == 422
    assert post(server, {"queries": ["x"], "topk": 100}).status_code == 400
    assert post(server, {"queries": []}).json() == {"result": []}
    overlong = post(server, {"queries": ["harbour city " * 50000], "topk": 1})
    assert overlong.status_code == 200 and len(overlong.json()["result"][0]) == 1
    assert server.is_alive() and post(server, {"queries": ["founder"], "topk": 1}).status_code == 200


def test_index_is_owned_by_the_server_process(server, kb, minilm_dir):
    corpus = kb["index"].parent / "kb" / "corpus.jsonl"
    with pytest.raises(RuntimeError, match="open in another process"):
        build_index(corpus, kb["index"], encoder=str(minilm_dir), sparse="bm25", show_progress=False)


def test_search_tool_against_the_real_server(server, kb):
    questions = kb["questions"][:32]

    async def main():
        tool = SearchTool(server.addr, topk=3)
        before = requests.get(f"{server.url}/health", timeout=5).json()["num_batches"]
        results = await asyncio.gather(*(tool.search([q["gold_queries"][0]]) for q in questions))
        after = requests.get(f"{server.url}/health", timeout=5).json()["num_batches"]
        with pytest.raises(SearchError, match="HTTP 400"):
            await tool.search(["x"], topk=99)
        await tool.close()
        return tool, results, after - before

    tool, results, num_batches = asyncio.run(main())
    assert all(len(result) == 1 and len(result[0]) == 3 for result in results)
    found = sum(
        q["gold_passage_ids"][0] in [h["document"]["id"] for h in r[0]]
        for r, q in zip(results, questions, strict=True)
    )
    assert found >= 0.8 * len(questions)
    assert num_batches < len(questions)  # 32 concurrent HTTP requests were micro-batched
    assert (tool.num_calls, tool.num_errors, tool.num_retries) == (33, 1, 0)
    assert tool.latency_s_total > 0


def test_search_tool_when_the_server_goes_down(kb, tmp_path):
    """A server of its own, since it stops it (on a copy of the index: a served index has one owner)."""
    server = RetrievalServerProcess(shutil.copytree(kb["index"], tmp_path / "index"), mode="hybrid")

    async def main():
        tool = SearchTool(server.addr, max_retries=2, backoff_s=0.05, timeout_s=5.0)
        assert len((await tool.search(["founder"]))[0]) == 3
        server.stop()
        start = time.perf_counter()
        with pytest.raises(
            SearchError, match=f"retrieval server http://{server.addr}/retrieve did not answer"
        ):
            await tool.search(["founder"])
        elapsed = time.perf_counter() - start
        await tool.close()
        return tool, elapsed

    with server:
        tool, elapsed = asyncio.run(main())
    assert elapsed >= 0.05 + 0.1
    assert (tool.num_calls, tool.num_errors, tool.num_retries) == (2, 1, 2)


def test_num_threads_caps_the_servers_thread_pools(server, kb, tmp_path):
    """retrieval.num_threads reaches the child before numpy starts OpenBLAS (its environment) and caps the
    pools it loaded (the flag); the module's server, started without it, keeps one thread per core."""
    capped = RetrievalServerProcess(
        shutil.copytree(kb["index"], tmp_path / "index"), mode="hybrid", num_threads=1
    )
    assert capped.server_args()[-2:] == ["--num-threads", "1"]
    with capped:
        health = requests.get(f"{capped.url}/health", timeout=5).json()
        environ = dict(
            item.split("=", 1)
            for item in open(f"/proc/{capped.proc.pid}/environ").read().split("\0")
            if "=" in item
        )
        assert post(capped, {"queries": ["founder"], "topk": 2}).status_code == 200
    assert health["num_threads"] == 1 and health["blas_threads"] == 1
    assert environ["OPENBLAS_NUM_THREADS"] == environ["OMP_NUM_THREADS"] == "1"
    assert "num_threads" not in requests.get(f"{server.url}/health", timeout=5).json()
