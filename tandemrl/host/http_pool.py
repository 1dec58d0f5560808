"""The connection pool of tandem's HTTP clients (the engine clients in rollout/, the search tool in agent/).

uvicorn closes a keep-alive connection after it has been idle for 5 s (its default `timeout_keep_alive`,
which vLLM 0.24 keeps as VLLM_HTTP_TIMEOUT_KEEP_ALIVE, SGLang passes to uvicorn.run, and our retrieval
server inherits). aiohttp's pool keeps an idle connection for 15 s by default and hands out the oldest
first, so a request can be written onto a connection that the server is closing at that moment; the
server's kernel answers with a reset, and the request fails with "Connection reset by peer" (seen on an
H100: one request in about 1,900 of the async recipe on launched vLLM 0.24, which stopped the run; against
a real uvicorn, 753 of 6,400 requests after idle gaps of 4.9-5.1 s failed from aiohttp's default pool and none from
this one, benchmarks/robustness/keepalive_race.py).
Invariant: the pool reuses a connection only while it has been idle for at most KEEPALIVE_S, a second
below uvicorn's 5 s, so it never sends on one the server may be closing.
"""

from __future__ import annotations

import aiohttp

UVICORN_KEEPALIVE_S = 5.0  # uvicorn's default timeout_keep_alive
KEEPALIVE_S = 4.0  # ours: a second below it


def pooled_connector(limit: int) -> aiohttp.TCPConnector:
    """A connector for one client session: at most `limit` connections (0: no limit), each reused only
    while idle for at most KEEPALIVE_S."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S)
