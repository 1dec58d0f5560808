"""The agent loop's search tool: an async client of a Search-R1 `/retrieve` server, and the rendering of
its documents into Search-R1's `Doc i(Title: ...) text` lines.

Invariants: one aiohttp session per event loop, created lazily inside the running loop and reused by
every call (agent loops issue thousands of searches); a failed call is retried with exponential backoff
and then raises `SearchError` with a message the agent loop can show the model — it never hangs past
`timeout_s` per attempt, and every call is counted in `num_calls` / `num_errors` / `latency_s_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from tandemrl.host.http_guard import auth_headers
from tandemrl.host.http_pool import pooled_connector

log = logging.getLogger(__name__)


class SearchError(RuntimeError):
    """The retrieval server could not answer (down, timing out, or rejecting the request)."""


def retrieve_url(server_addr: str) -> str:
    """`host:port`, `http://host:port` or a full `.../retrieve` URL (Search-R1's `search_url`)."""
    url = server_addr if server_addr.startswith(("http://", "https://")) else f"http://{server_addr}"
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else f"{url}/retrieve"


def format_documents(docs: list[dict]) -> str:
    """Search-R1's `_passages2string`, byte for byte: the title is the first line of `contents` as is
    (wiki-18 writes it in quotes, so the model sees `(Title: "Name")`), the text is the rest."""
    lines = []
    for i, doc_item in enumerate(docs):
        document = (
            doc_item["document"] if "document" in doc_item else doc_item
        )  # return_scores false: bare docs
        content = document["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        lines.append(f"Doc {i + 1}(Title: {title}) {text}\n")
    return "".join(lines)


class SearchTool:
    def __init__(
        self,
        server_addr: str,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ):
        if not 1 <= topk <= 50:
            raise ValueError(f"topk={topk}: must be in 1..50 (the retrieval server's limit).")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"timeout_s={timeout_s}, max_retries={max_retries}, backoff_s={backoff_s}: need "
                "timeout_s > 0, max_retries >= 0 and backoff_s >= 0."
            )
        self.url = retrieve_url(server_addr)
        self._headers = auth_headers(api_key)  # never logged
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.num_calls = 0
        self.num_errors = 0  # calls that raised SearchError after all retries
        self.num_retries = 0  # failed attempts that were retried
        self.latency_s_total = 0.0
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, server_addr: str, search_cfg, api_key: str | None = None) -> SearchTool:
        """The tool `tools.search` describes (topk, timeout, retries, backoff), at `server_addr`."""
        return cls(
            server_addr,
            topk=search_cfg.topk,
            timeout_s=search_cfg.timeout_s,
            max_retries=search_cfg.max_retries,
            backoff_s=search_cfg.backoff_s,
            api_key=api_key,
        )

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session is bound to the loop it was made in; a new loop (e.g. a new asyncio.run) needs its own.
            connector = pooled_connector(256)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=self._headers,
            )
            self._session_loop = loop
        return self._session

    @property
    def health_url(self) -> str:
        return self.url.removesuffix("/retrieve") + "/health"

    async def health(self) -> bool:
        """Whether the server answers HTTP at all (a Search-R1 server has only /retrieve, so any status
        counts): the run's watchdog tells a dead external server from a slow one by this."""
        try:
            async with self._get_session().get(self.health_url) as response:
                return response.status > 0
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def server_info(self) -> dict:
        """The server's /health body ({} where it has none or is not ours: a Search-R1 server has only
        /retrieve); tandem's server counts its batches, queries, busy and queueing seconds there."""
        try:
            async with self._get_session().get(self.health_url) as response:
                if response.status != 200:
                    return {}
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Per query, `topk` hits `{"document": {"id", "contents"}, "score"}`, best first."""
        if not queries:
            return []
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        self.num_calls += 1
        start = time.perf_counter()
        try:
            return await self._post_with_retries(body)
        except SearchError:
            self.num_errors += 1
            raise
        finally:
            self.latency_s_total += time.perf_counter() - start

    async def _post_with_retries(self, body: dict) -> list[list[dict]]:
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return await self._post(body)
            except _Retryable as error:
                last_error = str(error)
                log.debug("search attempt %d/%d failed: %s", attempt + 1, self.max_retries + 1, last_error)
        raise SearchError(
            f"search failed: retrieval server {self.url} did not answer after "
            f"{self.max_retries + 1} attempts ({last_error})."
        )

    async def _post(self, body: dict) -> list[list[dict]]:
        try:
            async with self._get_session().post(self.url, json=body) as response:
                if response.status >= 500 or response.status == 429:
                    raise _Retryable(f"HTTP {response.status}: {(await response.text())[:200]}")
                if response.status != 200:  # a 4xx will not improve with retries
                    raise SearchError(
                        f"search failed: retrieval server {self.url} rejected the request with "
                        f"HTTP {response.status}: {(await response.text())[:300]}"
                    )
                payload = await response.json()
        except ValueError as error:  # a body that is not JSON: not a retrieval server, retrying won't help
            raise SearchError(f"search failed: {self.url} answered with invalid JSON ({error}).") from error
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            raise _Retryable(
                f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            ) from error
        result = payload.get("result") if isinstance(payload, dict) else None
        if not isinstance(result, list) or len(result) != len(body["queries"]):
            raise SearchError(
                f"search failed: retrieval server {self.url} answered without a 'result' list of "
                f"{len(body['queries'])} entries."
            )
        return result

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not (connection refused, timeout, 5xx)."""
