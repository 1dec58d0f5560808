"""SearchTool client: Search-R1 rendering, retries with backoff, error texts and counters."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from tandemrl.agent.search_tool import SearchError, SearchTool, format_documents, retrieve_url
from tests.conftest import free_port


def hit(pid: str, contents: str, score: float = 0.5) -> dict:
    return {"document": {"id": pid, "contents": contents}, "score": score}


def test_format_documents_is_search_r1_passages2string():
    docs = [
        hit("1", '"Marrowdale"\nMarrowdale is a river town.'),
        hit("2", '"Alaric Venn"\nLine one.\nLine two.'),
        hit("3", "No title line"),
    ]
    assert format_documents(docs) == (
        'Doc 1(Title: "Marrowdale") Marrowdale is a river town.\n'
        'Doc 2(Title: "Alaric Venn") Line one.\nLine two.\n'
        "Doc 3(Title: No title line) \n"
    )
    assert format_documents([{"id": "1", "contents": '"T"\nx'}]) == 'Doc 1(Title: "T") x\n'  # bare documents
    assert format_documents([]) == ""


def test_retrieve_url_accepts_the_usual_spellings():
    assert retrieve_url("127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"
    assert retrieve_url("http://host:9/") == "http://host:9/retrieve"
    assert retrieve_url("http://host:9/retrieve") == "http://host:9/retrieve"


def test_constructor_rejects_bad_settings():
    with pytest.raises(ValueError, match="topk=0"):
        SearchTool("127.0.0.1:1", topk=0)
    with pytest.raises(ValueError, match="timeout_s"):
        SearchTool("127.0.0.1:1", timeout_s=0)


def test_server_down_retries_with_backoff_then_raises():
    tool = SearchTool(f"127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.1, timeout_s=2.0)

    async def main():
        start = time.perf_counter()
        with pytest.raises(SearchError, match=r"did not answer after 3 attempts \(Client.*Error"):
            await tool.search(["anything"])
        elapsed = time.perf_counter() - start
        assert await tool.search([]) == []  # no queries: no call at all
        await tool.close()
        return elapsed

    elapsed = asyncio.run(main())
    assert elapsed >= 0.1 + 0.2  # backoff 0.1 s, then 0.2 s
    assert (tool.num_calls, tool.num_errors, tool.num_retries) == (1, 1, 2)
    assert tool.latency_s_total >= 0.3


class FakeFlakyRetrievalServer:
    """Stands in for the retrieval server process: answers HTTP 503 `num_failures` times, then a
    Search-R1 style result; a query "slow" sleeps past the client's timeout, "bad" gets a 400."""

    def __init__(self, num_failures: int):
        self.num_failures = num_failures
        self.num_requests = 0
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        body = await request.json()
        if body["queries"] == ["slow"]:
            await asyncio.sleep(1.0)
        if body["queries"] == ["bad"]:
            return web.json_response({"error": "topk=99: must be in 1..50."}, status=400)
        if self.num_failures > 0:
            self.num_failures -= 1
            return web.json_response({"error": "busy"}, status=503)
        result = [
            [hit(str(i), f'"{query}"\ntext', 1.0)] * body["topk"] for i, query in enumerate(body["queries"])
        ]
        return web.json_response({"result": result})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/retrieve", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def test_retries_5xx_then_succeeds_and_reuses_one_session():
    async def main():
        async with FakeFlakyRetrievalServer(num_failures=2) as server:
            tool = SearchTool(f"127.0.0.1:{server.port}", topk=2, max_retries=3, backoff_s=0.01)
            first = await tool.search(["q1", "q2"])
            session = tool._session
            second = await tool.search(["q3"])
            assert tool._session is session  # one session for every call in this loop
            await tool.close()
            return tool, server, first, second

    tool, server, first, second = asyncio.run(main())
    assert [len(r) for r in first] == [2, 2] and first[1][0]["document"]["contents"] == '"q2"\ntext'
    assert second[0][0]["document"]["contents"] == '"q3"\ntext'
    assert server.num_requests == 4
    assert (tool.num_calls, tool.num_errors, tool.num_retries) == (2, 0, 2)


def test_4xx_is_not_retried_and_timeouts_are():
    async def main():
        async with FakeFlakyRetrievalServer(num_failures=0) as server:
            tool = SearchTool(f"127.0.0.1:{server.port}", max_retries=1, backoff_s=0.0, timeout_s=0.3)
            with pytest.raises(SearchError, match="rejected the request with HTTP 400: .*topk=99"):
                await tool.search(["bad"])
            requests_after_bad = server.num_requests
            with pytest.raises(SearchError, match="after 2 attempts \\(TimeoutError"):
                await tool.search(["slow"])
            await tool.close()
            return tool, requests_after_bad, server.num_requests

    tool, requests_after_bad, num_requests = asyncio.run(main())
    assert requests_after_bad == 1 and num_requests == 3
    assert (tool.num_calls, tool.num_errors, tool.num_retries) == (2, 2, 1)


def test_a_new_event_loop_gets_a_new_session():
    async def call(tool):
        await tool.search(["q"])
        return tool._session

    async def main(server_port_holder):
        async with FakeFlakyRetrievalServer(num_failures=0) as server:
            server_port_holder.append(server.port)
            tool = SearchTool(f"127.0.0.1:{server.port}")
            first = await call(tool)
            # a second asyncio.run on the same tool (e.g. a sync caller) must not reuse a dead loop's session
            second = await asyncio.get_running_loop().run_in_executor(None, asyncio.run, call(tool))
            assert first is not second
            await tool.close()

    asyncio.run(main([]))
