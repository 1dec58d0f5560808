"""The engine clients and the search tool never send on a connection that uvicorn (vLLM, SGLang, our retrieval
server) may be closing: a pooled connection idle for KEEPALIVE_S or more is replaced, one idle for less is
reused (host/http_pool.py). The idle time is set by moving aiohttp's pool clock, not by sleeping, so the
test is deterministic; the server is a real aiohttp server that records each request's client port."""

from __future__ import annotations

import asyncio

import aiohttp.connector
import pytest
from aiohttp import web

from tandemrl.agent.search_tool import SearchTool
from tandemrl.host.http_pool import KEEPALIVE_S, UVICORN_KEEPALIVE_S
from tandemrl.rollout.client import EngineClient
from tests.aiohttp_app import serving


class PoolClock:
    """Stands in for aiohttp.connector.monotonic: the time the pool sees, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def client_ports(idle_gaps_s: list[float], clock: PoolClock) -> list[int]:
    """One request, then one more after each idle gap; the client port the server saw for each."""
    ports: list[int] = []

    async def ping(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/ping", ping)
    async with serving(app) as address:
        client = EngineClient(f"http://{address}")
        try:
            await client.post("/ping")
            for gap in idle_gaps_s:
                clock.now += gap
                await client.post("/ping")
        finally:
            await client.close()
    return ports


def test_a_connection_idle_for_less_than_the_pool_limit_is_reused_and_not_after(monkeypatch):
    assert KEEPALIVE_S < UVICORN_KEEPALIVE_S
    clock = PoolClock()
    monkeypatch.setattr(aiohttp.connector, "monotonic", clock)
    short, long = KEEPALIVE_S - 0.5, (KEEPALIVE_S + UVICORN_KEEPALIVE_S) / 2  # 3.5 s and 4.5 s
    ports = asyncio.run(client_ports([short, long, short], clock))
    assert ports[1] == ports[0]  # idle 3.5 s: the same connection
    assert ports[2] != ports[1]  # idle 4.5 s: uvicorn may be closing it at 5 s, so a new one
    assert ports[3] == ports[2]


@pytest.mark.parametrize("make_session", ["engine", "search"])
def test_every_client_session_uses_the_pool_limit(make_session):
    async def keepalive() -> float:
        if make_session == "engine":
            client = EngineClient("http://127.0.0.1:1")
            session = client._http()
        else:
            client = SearchTool("http://127.0.0.1:1")
            session = client._get_session()
        try:
            return session.connector._keepalive_timeout
        finally:
            await session.close()

    assert asyncio.run(keepalive()) == KEEPALIVE_S
