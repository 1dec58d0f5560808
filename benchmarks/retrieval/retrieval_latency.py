"""Query latency of the real retrieval server (`tandem serve-retrieval` in its own process), one query per
HTTP request, with 1 and 32 concurrent clients; used by benchmarks/retrieval/retrieval.py --server-latency."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from tandemrl.retrieval.server_process import RetrievalServerProcess

TOPK = 3


async def _client(url: str, queries: list[str], latencies_s: list[float], session) -> None:
    for query in queries:
        start = time.perf_counter()
        async with session.post(
            url, json={"queries": [query], "topk": TOPK, "return_scores": True}
        ) as response:
            body = await response.json()
            if response.status != 200 or len(body["result"]) != 1:
                raise RuntimeError(f"bad answer from {url}: HTTP {response.status} {body}")
        latencies_s.append(time.perf_counter() - start)


async def _latency(url: str, queries: list[str], num_clients: int, requests_per_client: int) -> dict:
    import aiohttp

    latencies_s: list[float] = []
    async with aiohttp.ClientSession() as session:
        await _client(url, queries[:4], [], session)  # warm the connection pool and the server
        chunks = [
            queries[i * requests_per_client : (i + 1) * requests_per_client] for i in range(num_clients)
        ]
        start = time.perf_counter()
        await asyncio.gather(*(_client(url, chunk, latencies_s, session) for chunk in chunks))
        wall_s = time.perf_counter() - start
    quantiles = statistics.quantiles(latencies_s, n=100)
    return {
        "num_clients": num_clients,
        "num_requests": len(latencies_s),
        "p50_ms": round(quantiles[49] * 1000, 2),
        "p95_ms": round(quantiles[94] * 1000, 2),
        "requests_per_s": round(len(latencies_s) / wall_s, 1),
    }


def measure_latency(index_dir: Path, mode: str, queries: list[str], num_requests: int) -> dict:
    out = {}
    with RetrievalServerProcess(index_dir, mode=mode) as server:
        for num_clients in (1, 32):
            per_client = max(num_requests // num_clients, 4) if num_clients > 1 else num_requests
            needed = per_client * num_clients
            pool = (queries * (needed // max(len(queries), 1) + 1))[:needed]
            out[str(num_clients)] = asyncio.run(
                _latency(f"{server.url}/retrieve", pool, num_clients, per_client)
            )
            print(
                f"  {mode:6s} {num_clients:2d} client(s): p50 {out[str(num_clients)]['p50_ms']:.1f} ms, "
                f"p95 {out[str(num_clients)]['p95_ms']:.1f} ms, "
                f"{out[str(num_clients)]['requests_per_s']:.0f} req/s",
                flush=True,
            )
        out["server"] = server.health()
    return out
