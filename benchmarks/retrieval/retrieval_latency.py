"""Query latency of the real retrieval server (`tandem serve-retrieval` in its own process), one query per
HTTP request, with 1 and 32 concurrent clients back to back and with 32 paced clients (each waits
`PACE_S` between its requests, as agents do between turns), and the CPU the server process used meanwhile
(cores = its CPU seconds over the wall time), for each size of its thread pools (`retrieval.num_threads`;
0: one thread per core); used by benchmarks/retrieval/retrieval.py --server-latency."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

from tandemrl.retrieval.server_process import RetrievalServerProcess

TOPK = 3
PACE_S = 0.05  # a paced client's wait between two requests


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(
    url: str, queries: list[str], latencies_s: list[float], session, pace_s: float = 0.0
) -> None:
    for query in queries:
        if pace_s:
            await asyncio.sleep(pace_s)
        start = time.perf_counter()
        async with session.post(
            url, json={"queries": [query], "topk": TOPK, "return_scores": True}
        ) as response:
            body = await response.json()
            if response.status != 200 or len(body["result"]) != 1:
                raise RuntimeError(f"bad answer from {url}: HTTP {response.status} {body}")
        latencies_s.append(time.perf_counter() - start)


async def _latency(
    url: str, queries: list[str], num_clients: int, requests_per_client: int, pid: int, pace_s: float = 0.0
) -> dict:
    import aiohttp

    latencies_s: list[float] = []
    async with aiohttp.ClientSession() as session:
        await _client(url, queries[:4], [], session)  # warm the connection pool and the server
        chunks = [
            queries[i * requests_per_client : (i + 1) * requests_per_client] for i in range(num_clients)
        ]
        start, cpu_start = time.perf_counter(), _cpu_s(pid)
        await asyncio.gather(*(_client(url, chunk, latencies_s, session, pace_s) for chunk in chunks))
        wall_s, cpu_s = time.perf_counter() - start, _cpu_s(pid) - cpu_start
    quantiles = statistics.quantiles(latencies_s, n=100)
    return {
        "num_clients": num_clients,
        "num_requests": len(latencies_s),
        "p50_ms": round(quantiles[49] * 1000, 2),
        "p95_ms": round(quantiles[94] * 1000, 2),
        "requests_per_s": round(len(latencies_s) / wall_s, 1),
        "server_cores": round(cpu_s / wall_s, 2),
        "server_cpu_ms_per_request": round(cpu_s / len(latencies_s) * 1000, 2),
    }


def measure_latency(
    index_dir: Path, mode: str, queries: list[str], num_requests: int, thread_counts: tuple[int, ...] = (0,)
) -> dict:
    """Per thread-pool size ("threads_<n>"): each load's latency, rate and the server's CPU."""
    out = {}
    loads = (("1", 1, 0.0), ("32", 32, 0.0), ("32_paced", 32, PACE_S))
    for num_threads in thread_counts:
        runs: dict = {}
        with RetrievalServerProcess(index_dir, mode=mode, num_threads=num_threads) as server:
            for name, num_clients, pace_s in loads:
                per_client = max(num_requests // num_clients, 4) if num_clients > 1 else num_requests
                needed = per_client * num_clients
                pool = (queries * (needed // max(len(queries), 1) + 1))[:needed]
                runs[name] = result = asyncio.run(
                    _latency(f"{server.url}/retrieve", pool, num_clients, per_client, server.proc.pid, pace_s)
                )
                print(
                    f"  {mode:6s} threads {num_threads or 'per core'}, {name:>8s} client(s): p50 "
                    f"{result['p50_ms']:.1f} ms, p95 {result['p95_ms']:.1f} ms, {result['requests_per_s']:.0f} "
                    f"req/s, server {result['server_cores']:.2f} cores "
                    f"({result['server_cpu_ms_per_request']:.1f} ms CPU a request)",
                    flush=True,
                )
            runs["server"] = server.health()
        out[f"threads_{num_threads}"] = runs
    return out
