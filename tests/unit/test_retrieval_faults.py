"""The retrieval server under faults and hostile input, in-process (httpx over ASGI) on a tiny real index:
a poison query among concurrent good ones, oversize requests, a large request beside a small one, and
the API key (docs/RELIABILITY.md lists what each test guards)."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest

from tandemrl.host.http_guard import PORT_IN_USE_EXIT
from tandemrl.retrieval.batcher import MicroBatcher
from tandemrl.retrieval.server import create_app, run_serve
from tandemrl.retrieval.store import Hit
from tests.unit.test_retrieval_server import retriever  # noqa: F401  (the module's index fixture)


def serve(search, body, api_key=None, max_request_mb=4.0, **batcher_kwargs):
    async def main():
        batcher = MicroBatcher(search, **batcher_kwargs)
        app = create_app(batcher, {"mode": "hybrid"}, api_key=api_key, max_request_mb=max_request_mb)
        await batcher.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                return await body(client, batcher)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_a_lone_surrogate_among_60_concurrent_requests_fails_alone(retriever):  # noqa: F811
    """Valid JSON ("\\ud800" escaped), unencodable text: a 400 for that request, 200 for the other 60."""
    poison = '{"queries": ["\\ud800"], "topk": 1}'

    async def body(client, _):
        good = [
            client.post("/retrieve", json={"queries": ["Who wrote The Iron Meadow?"], "topk": 1})
            for _ in range(60)
        ]
        bad = client.post("/retrieve", content=poison, headers={"content-type": "application/json"})
        return await asyncio.gather(bad, *good)

    bad, *good = serve(retriever.search, body, max_wait_s=0.05)
    assert bad.status_code == 400 and "queries[0]" in bad.json()["error"], bad.text
    assert [r.status_code for r in good] == [200] * 60
    assert all(r.json()["result"][0][0]["id"] == "p4" for r in good)


def test_a_query_that_breaks_the_search_fails_only_its_request(retriever):  # noqa: F811
    def search_failing_on_poison(queries, topks):
        """The real search with a fault injected for one query (stands in for an encoder or Qdrant error)."""
        if "poison" in queries:
            raise RuntimeError("injected failure")
        return retriever.search(queries, topks)

    async def body(client, batcher):
        requests = [client.post("/retrieve", json={"queries": ["violinist"], "topk": 1}) for _ in range(60)]
        requests.insert(30, client.post("/retrieve", json={"queries": ["poison"], "topk": 1}))
        return await asyncio.gather(*requests), batcher.num_failed_requests

    responses, num_failed = serve(search_failing_on_poison, body, max_wait_s=0.05)
    statuses = [r.status_code for r in responses]
    assert statuses[30] == 500 and "injected failure" in responses[30].json()["error"]
    assert statuses[:30] + statuses[31:] == [200] * 60 and num_failed == 1


def test_oversize_requests_get_413(retriever):  # noqa: F811
    async def body(client, _):
        too_many = await client.post("/retrieve", json={"queries": ["q"] * 1025})
        too_big = await client.post("/retrieve", json={"queries": ["x" * 1000] * 1000})  # ~1 MB > 0.5 MiB
        long_query = await client.post("/retrieve", json={"queries": ["x" * 5000]})

        async def chunks():  # no Content-Length: counted while it streams in
            for _ in range(20):
                yield b" " * 65536

        streamed = await client.post(
            "/retrieve", content=chunks(), headers={"content-type": "application/json"}
        )
        after = await client.post("/retrieve", json={"queries": ["violinist"], "topk": 1})
        return too_many, too_big, long_query, streamed, after

    too_many, too_big, long_query, streamed, after = serve(retriever.search, body, max_request_mb=0.5)
    assert too_many.status_code == 413 and "1025 queries" in too_many.json()["error"]
    assert too_big.status_code == 413 and "too large" in too_big.json()["error"]
    assert long_query.status_code == 200  # cut to MAX_QUERY_CHARS, as the encoder would cut it
    assert streamed.status_code == 413 and "too large" in streamed.json()["error"]
    assert after.status_code == 200


def test_a_small_request_is_not_stuck_behind_a_large_one():
    """512 queries, then 1: the small one is answered after one slice, long before the large one ends."""
    order: list[int] = []

    def slow_search(queries, topks):
        """Stands in for the encoder + Qdrant: 2 ms per query, one empty hit list per query."""
        time.sleep(0.002 * len(queries))
        order.append(len(queries))
        return [[] for _ in queries]

    async def body(client, _):
        large = asyncio.create_task(client.post("/retrieve", json={"queries": [f"q{i}" for i in range(512)]}))
        while not order:  # its first slice is done: the large one is being worked through
            await asyncio.sleep(0.001)
        small = asyncio.create_task(client.post("/retrieve", json={"queries": ["one"]}))
        done, _ = await asyncio.wait([large, small], return_when=asyncio.FIRST_COMPLETED)
        first = "small" if small in done else "large"
        return first, await large, await small

    first, large, small = serve(slow_search, body, max_wait_s=0.0, max_batch_queries=64, max_slice_queries=64)
    assert first == "small" and small.status_code == 200 and len(large.json()["result"]) == 512
    assert max(order) <= 64 and sum(order) == 513


def test_the_api_key_guards_retrieve_but_not_health():
    def search(queries, topks):
        """Stands in for the retriever: one fixed hit per query."""
        return [[Hit({"id": "d", "contents": "t"}, 1.0)] for _ in queries]

    async def body(client, _):
        return [
            await client.post("/retrieve", json={"queries": ["q"]}),
            await client.post("/retrieve", json={"queries": ["q"]}, headers={"Authorization": "Bearer no"}),
            await client.post("/retrieve", json={"queries": ["q"]}, headers={"Authorization": "Bearer k3y"}),
            await client.get("/health"),
        ]

    missing, wrong, right, health = serve(search, body, api_key="k3y")
    assert missing.status_code == wrong.status_code == 401 and "API key" in missing.json()["error"]
    assert "k3y" not in missing.text
    assert right.status_code == 200 and health.status_code == 200


def test_serving_beyond_loopback_needs_a_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_RETRIEVAL_API_KEY", raising=False)
    args = argparse.Namespace(
        index=str(tmp_path), host="0.0.0.0", port=0, mode=None, qdrant_url=None, api_key=None
    )
    assert run_serve(args) == 2
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_needs_no_key(host, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_RETRIEVAL_API_KEY", raising=False)
    args = argparse.Namespace(
        index=str(tmp_path / "missing"), host=host, port=0, mode=None, qdrant_url=None, api_key=None
    )
    with pytest.raises(FileNotFoundError, match="not a built index"):  # past the key check, at the index
        run_serve(args)
    assert "--api-key" not in capsys.readouterr().err


# ---- round two (docs/RELIABILITY.md rows 16-17) ------------------------------------------------------


def _fixed_hit_search(queries, topks):
    """Stands in for the retriever: one fixed hit per query (what an empty query got before)."""
    return [[Hit({"id": "d", "contents": "t"}, 1.0)] for _ in queries]


def test_empty_or_blank_queries_are_400_naming_the_query():
    async def body(client, _):
        cases = [["", "ok"], ["ok", "   "], ["\t\n"]]
        return [await client.post("/retrieve", json={"queries": queries}) for queries in cases]

    first, second, third = serve(_fixed_hit_search, body)
    for response, index in ((first, 0), (second, 1), (third, 0)):
        assert response.status_code == 400, response.text
        assert f"queries[{index}] is empty or only whitespace" in response.json()["error"]


BAD_BODIES = {
    "not UTF-8 inside a string": b'{"queries": ["\xff\xfe"]}',
    "not UTF-8 at all": b"\xff\xfe\xfd",
    "malformed JSON": b'{"queries": [',
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "a JSON array": b'["q"]',
    "a number": b"7",
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_every_bad_body_gets_the_one_error_shape(case):
    """Before, a non-UTF-8 body got FastAPI's {"detail": ...} where every other error has "error"."""

    async def body(client, _):
        return await client.post(
            "/retrieve", content=BAD_BODIES[case], headers={"content-type": "application/json"}
        )

    response = serve(_fixed_hit_search, body)
    assert 400 <= response.status_code < 500, response.text
    assert isinstance(response.json().get("error"), str) and "body" in response.json()["error"], response.text


def test_a_body_without_a_content_type_is_read_as_json():
    async def body(client, _):
        return await client.post("/retrieve", content=b'{"queries": ["q"]}')

    response = serve(_fixed_hit_search, body)
    assert response.status_code == 200 and response.json()["result"][0][0]["id"] == "d", response.text


def test_a_key_header_that_is_not_utf8_is_401():
    async def body(client, _):
        return await client.post(
            "/retrieve", json={"queries": ["q"]}, headers={"Authorization": b"Bearer \xff\xfe"}
        )

    response = serve(_fixed_hit_search, body, api_key="k3y")
    assert response.status_code == 401 and "API key" in response.json()["error"]


def test_health_does_not_show_where_the_index_lives(prepared_home, tmp_path):
    from tandemrl.retrieval.build import build_index
    from tandemrl.retrieval.server_process import RetrievalServerProcess
    from tests.unit.test_retrieval_index import PASSAGES, write_corpus

    index = tmp_path / "secret-place" / "index"
    build_index(write_corpus(tmp_path / "c.jsonl", PASSAGES[:2]), index, show_progress=False)
    with RetrievalServerProcess(index) as server:
        health = httpx.get(f"http://{server.addr}/health", timeout=30)
    assert health.status_code == 200 and health.json()["num_passages"] == 2
    assert "secret-place" not in health.text and str(tmp_path) not in health.text, health.text


def test_a_port_in_use_is_reported_before_the_index_is_opened(tmp_path, capsys, monkeypatch):
    import socket

    monkeypatch.delenv("TANDEM_RETRIEVAL_API_KEY", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = argparse.Namespace(
            index=str(tmp_path / "no-index-here"),
            host="127.0.0.1",
            port=port,
            mode=None,
            qdrant_url=None,
            api_key=None,
        )
        assert run_serve(args) == PORT_IN_USE_EXIT  # the missing index would be found only after the bind
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is already in use" in err and "not a built index" not in err, err
