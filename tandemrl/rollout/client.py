"""Async client for an engine speaking SGLang's HTTP protocol (the embedded engine or a real SGLang).

Relies only on SGLang's documented fields; our extension `output_token_weight_versions` is read when
present and is None otherwise. Invariant: `generate` returns exactly the tokens the engine sampled
(no decode/re-encode) with one logprob per token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from tandemrl.engine.http_guard import auth_headers


class EngineError(RuntimeError):
    """The engine answered with an error status; the message carries its reason."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]  # logprob of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None
    weight_versions: list[int] | None  # per output token (our extension; None against a real SGLang)
    weight_version: str | None  # meta_info["weight_version"]
    prompt_tokens: int

    @classmethod
    def from_response(cls, body: dict) -> GenerateResult:
        meta = body.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        output_ids = list(body.get("output_ids") or [])
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(logprobs) != len(output_ids):
            raise EngineError(
                f"engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs; "
                "send return_logprob=true"
            )
        versions = meta.get("output_token_weight_versions")
        weight_version = meta.get("weight_version")
        return cls(
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=reason.get("type", "abort"),
            matched_stop=reason.get("matched"),
            weight_versions=None if versions is None else list(versions),
            weight_version=None if weight_version is None else str(weight_version),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
        )


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = auth_headers(api_key)  # sent on every request; never logged
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        # A session belongs to one event loop; a client reused under a new loop opens a new session.
        if self._session is not None and self._session_loop is not asyncio.get_running_loop():
            self._session = None
        if self._session is None or self._session.closed:
            self._session_loop = asyncio.get_running_loop()
            connector = aiohttp.TCPConnector(limit=0)  # the engine batches; do not queue on our side
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=self._headers,
            )
        return self._session

    async def _post(self, path: str, body: dict | None = None) -> dict | str:
        async with self._http().post(self.base_url + path, json=body or {}) as resp:
            return await self._read(resp, path)

    async def _get(self, path: str) -> dict | str:
        async with self._http().get(self.base_url + path) as resp:
            return await self._read(resp, path)

    async def _read(self, resp: aiohttp.ClientResponse, path: str) -> dict | str:
        text = await resp.text()
        if resp.status != 200:
            raise EngineError(f"{self.base_url}{path} answered {resp.status}: {text[:500]}")
        if resp.content_type == "application/json":
            return await resp.json()
        return text

    async def generate(
        self, input_ids: list[int], sampling_params: dict, rid: str | None = None, extra: dict | None = None
    ) -> GenerateResult:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
        if rid is not None:
            body["rid"] = rid
        body.update(extra or {})
        return GenerateResult.from_response(await self._post("/generate", body))

    async def pause_generation(self, mode: str) -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation")

    async def abort_request(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def get_weight_version(self) -> str:
        body = await self._get("/get_weight_version")
        return str(body["weight_version"])

    async def health(self) -> bool:
        try:
            async with self._http().get(
                self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def server_info(self) -> dict:
        return await self._get("/get_server_info")

    async def post(self, path: str, body: dict | None = None) -> dict | str:
        """Any other endpoint (weight updates); raises EngineError on a non-200 answer."""
        return await self._post(path, body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
