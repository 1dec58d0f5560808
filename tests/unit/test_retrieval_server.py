"""The /retrieve app in-process (httpx over ASGI) on a tiny real index: API shape, bad input, batching."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tandemrl.retrieval.batcher import MicroBatcher
from tandemrl.retrieval.build import build_index
from tandemrl.retrieval.retriever import Retriever
from tandemrl.retrieval.server import create_app
from tests.unit.test_retrieval_index import PASSAGES, write_corpus


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("retrieval_server")
    corpus = write_corpus(root / "corpus.jsonl")
    build_index(corpus, root / "index", encoder=str(minilm_dir), sparse="bm25", show_progress=False)
    retriever = Retriever(Path(root / "index"), mode="hybrid")
    yield retriever
    retriever.close()


def serve(search, **batcher_kwargs):
    """Run `body(client, batcher)` against the app with a started batcher."""

    def run(body):
        async def main():
            batcher = MicroBatcher(search, **batcher_kwargs)
            app = create_app(batcher, {"mode": "hybrid"})
            await batcher.start()
            try:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                    return await body(client, batcher)
            finally:
                await batcher.stop()

        return asyncio.run(main())

    return run


def test_search_r1_response_shape(retriever):
    async def body(client, _):
        scored = await client.post(
            "/retrieve",
            json={"queries": ["Who wrote The Iron Meadow?", "violinist"], "topk": 2, "return_scores": True},
        )
        bare = await client.post("/retrieve", json={"queries": ["Who wrote The Iron Meadow?"], "topk": 2})
        health = await client.get("/health")
        return scored, bare, health

    scored, bare, health = serve(retriever.search)(body)
    assert scored.status_code == 200
    result = scored.json()["result"]
    assert len(result) == 2 and [len(r) for r in result] == [2, 2]
    assert result[0][0]["document"] == {"id": "p4", "contents": f'"The Iron Meadow"\n{PASSAGES[4][2]}'}
    assert isinstance(result[0][0]["score"], float) and result[0][0]["score"] >= result[0][1]["score"]
    # return_scores false (Search-R1's default): each query's entry is the bare list of documents
    assert bare.json() == {"result": [[hit["document"] for hit in result[0]]]}
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_bad_input_gets_4xx_naming_the_field(retriever):
    cases = [
        ({"queries": "just a string"}, 422, "queries"),
        ({"queries": ["ok", 3]}, 422, "queries.1"),
        ({"topk": 3}, 422, "queries"),
        ({"queries": ["ok"], "topk": "3"}, 422, "topk"),
        ({"queries": ["ok"], "return_scores": "yes"}, 422, "return_scores"),
        ({"queries": ["ok"], "topk": 0}, 400, "topk=0"),
        ({"queries": ["ok"], "topk": 51}, 400, "topk=51"),
        ({"queries": ["ok"] * 5000}, 413, "5000 queries"),
    ]

    async def body(client, _):
        responses = [await client.post("/retrieve", json=request) for request, _, _ in cases]
        malformed = await client.post(
            "/retrieve", content=b'{"queries": [', headers={"content-type": "application/json"}
        )
        empty = await client.post("/retrieve", json={"queries": []})
        after = await client.post("/retrieve", json={"queries": ["capital of Veltaria"], "topk": 1})
        return responses, malformed, empty, after

    responses, malformed, empty, after = serve(retriever.search)(body)
    for (_, status, field), response in zip(cases, responses, strict=True):
        assert response.status_code == status, response.text
        assert field in response.json()["error"], response.json()
    assert malformed.status_code == 422 and "malformed JSON" in malformed.json()["error"]
    assert empty.status_code == 200 and empty.json() == {"result": []}
    assert after.json()["result"][0][0]["id"] == "p7"  # still serving after all that


def test_concurrent_requests_share_encoder_calls(retriever):
    calls: list[int] = []

    def recording_search(queries, topks):
        calls.append(len(queries))
        return retriever.search(queries, topks)

    queries = [
        "Where was Alaric Venn born?",
        "Who wrote The Iron Meadow?",
        "capital city of Veltaria",
        "brewing company in Oskarport",
    ]

    async def body(client, _):
        requests = [
            client.post("/retrieve", json={"queries": [queries[i % 4]], "topk": 1}) for i in range(24)
        ]
        return await asyncio.gather(*requests)

    responses = serve(recording_search, max_wait_s=0.05)(body)
    first_ids = [r.json()["result"][0][0]["id"] for r in responses]
    assert first_ids == ["p0", "p4", "p7", "p5"] * 6  # each request got its own answer back
    assert sum(calls) == 24 and len(calls) < 24  # micro-batched: fewer encoder calls than requests


def test_health_counts_the_search_threads_work_and_the_queueing(retriever):
    """/health's cumulative counters: busy_s covers each batch's search (a search that sleeps 50 ms makes
    every batch at least that long), and queue_wait_s the time queries waited for their batch."""
    import time

    def slow_search(queries, topks):
        time.sleep(0.05)
        return retriever.search(queries, topks)

    async def body(client, _):
        before = (await client.get("/health")).json()
        requests = [client.post("/retrieve", json={"queries": ["violinist"], "topk": 1}) for _ in range(12)]
        await asyncio.gather(*requests)
        return before, (await client.get("/health")).json()

    before, after = serve(slow_search, max_wait_s=0.0, max_batch_queries=4, max_slice_queries=4)(body)
    assert before["num_queries"] == before["busy_s"] == before["queue_wait_s"] == 0
    assert after["num_queries"] == 12 and after["num_batches"] >= 3  # at most 4 queries a batch
    assert after["busy_s"] >= 0.05 * after["num_batches"]
    assert after["queue_wait_s"] > 0  # 12 requests at once, at most 4 a batch: some waited behind others


def test_a_failing_batch_fails_only_its_requests(retriever):
    def search_failing_on_boom(queries, topks):
        """The real search, with a fault injected for one query (stands in for a broken Qdrant call)."""
        if "boom" in queries:
            raise RuntimeError("injected failure")
        return retriever.search(queries, topks)

    async def body(client, batcher):
        failed = await client.post("/retrieve", json={"queries": ["boom"]})
        ok = await client.post("/retrieve", json={"queries": ["violinist"], "topk": 1})
        return failed, ok, batcher.num_batches

    failed, ok, num_batches = serve(search_failing_on_boom, max_wait_s=0.0)(body)
    assert failed.status_code == 500 and "injected failure" in failed.json()["error"]
    assert ok.status_code == 200 and ok.json()["result"][0][0]["id"] == "p1"
    assert num_batches == 1  # the failed batch is not counted, the server kept going


def test_a_payload_with_nan_or_infinity_is_answered_with_nulls_not_a_500():
    """An index built before `tandem index build` refused non-finite numbers may still hold one."""
    import json as json_module

    from tandemrl.retrieval.server import _render
    from tandemrl.retrieval.store import Hit

    hits = [[Hit({"id": "a", "contents": "x", "score": float("nan"), "m": [float("inf"), 1.5]}, 0.5)]]
    rendered = _render(hits, return_scores=True)
    assert json_module.loads(json_module.dumps(rendered, allow_nan=False)) == [
        [{"document": {"id": "a", "contents": "x", "score": None, "m": [None, 1.5]}, "score": 0.5}]
    ]
    assert _render(hits, return_scores=False)[0][0]["m"] == [None, 1.5]
