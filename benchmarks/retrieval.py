"""Retrieval benchmark: recall@3 of the gold passage (dense, BM25, hybrid), query latency of the real
server with 1 and 32 concurrent clients, and indexing throughput, on the default knowledge base.

    python benchmarks/retrieval.py [--kb DIR] [--max-questions N] [--out benchmarks/results/retrieval.json]

Recall uses every single-hop question's gold query (`gold_queries[0]`) and gold passage
(`gold_passage_ids[0]`); the raw question is scored as well, since that is what an untrained policy
tends to search for. Latency is measured over HTTP against `tandem serve-retrieval` in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tandemrl.data.home import default_kb_dir  # noqa: E402
from tandemrl.retrieval.build import build_index  # noqa: E402
from tandemrl.retrieval.retriever import Retriever  # noqa: E402
from tandemrl.retrieval.server_process import RetrievalServerProcess  # noqa: E402
from tandemrl.retrieval.store import MODES  # noqa: E402

TOPK = 3


def load_single_hop(kb_dir: Path, max_questions: int, seed: int) -> list[dict]:
    questions = []
    for split in ("train", "val", "test"):
        with open(kb_dir / f"{split}.jsonl", encoding="utf-8") as handle:
            questions += [q for q in map(json.loads, handle) if q["data_source"] == "kb_1hop"]
    random.Random(seed).shuffle(questions)
    return questions[:max_questions]


def recall(retriever: Retriever, mode: str, queries: list[str], gold_ids: list[str]) -> dict:
    """Recall@1 and @3 from one top-3 search per query; also the search time per query."""
    num_first = num_top3 = 0
    start = time.perf_counter()
    for offset in range(0, len(queries), 256):
        batch = queries[offset : offset + 256]
        results = retriever.search(batch, [TOPK] * len(batch), mode=mode)
        for hits, gold in zip(results, gold_ids[offset : offset + 256], strict=True):
            ids = [hit.document["id"] for hit in hits]
            num_first += ids[:1] == [gold]
            num_top3 += gold in ids
    num = max(len(queries), 1)
    return {
        "at_1": round(num_first / num, 4),
        "at_3": round(num_top3 / num, 4),
        "ms_per_query": round((time.perf_counter() - start) * 1000 / num, 2),
    }


def measure_recall(index_dir: Path, questions: list[dict]) -> dict:
    retriever = Retriever(index_dir, mode="hybrid")
    gold = [q["gold_passage_ids"][0] for q in questions]
    out: dict[str, dict] = {"recall_at_3": {}, "recall_at_1": {}, "question_recall_at_3": {}, "search_ms": {}}
    try:
        for mode in MODES:
            by_query = recall(retriever, mode, [q["gold_queries"][0] for q in questions], gold)
            by_question = recall(retriever, mode, [q["question"] for q in questions], gold)
            out["recall_at_3"][mode], out["recall_at_1"][mode] = by_query["at_3"], by_query["at_1"]
            out["question_recall_at_3"][mode] = by_question["at_3"]
            out["search_ms"][mode] = by_query["ms_per_query"]
            print(
                f"  {mode:6s} recall@3 {by_query['at_3']:.3f}  recall@1 {by_query['at_1']:.3f}  "
                f"question recall@3 {by_question['at_3']:.3f}  ({by_query['ms_per_query']:.1f} ms/query "
                "in process)",
                flush=True,
            )
    finally:
        retriever.close()
    return out


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


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kb",
        default=None,
        help="knowledge-base dir; 'default' = $TANDEM_HOME's prepared KB (default: generate "
        "the seed-0 KB afresh, so the figures match the current generator)",
    )
    parser.add_argument("--index", default=None, help="index dir to build into (default: a fresh temp dir)")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--max-questions", type=int, default=2000)
    parser.add_argument("--num-requests", type=int, default=200, help="requests per latency run")
    parser.add_argument(
        "--latency-modes", default="dense,hybrid", help="comma-separated server modes to time"
    )
    parser.add_argument("--out", default="benchmarks/results/retrieval.json")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, tmp: Path) -> dict:
    kb_dir = default_kb_dir() if args.kb == "default" else Path(args.kb) if args.kb else None
    if kb_dir is None:
        from tandemrl.data.kb import generate_kb

        print(f"generating the default knowledge base (seed 0) in {tmp / 'kb'}", flush=True)
        kb_dir = generate_kb(tmp / "kb", seed=0)
    index_dir = Path(args.index) if args.index else tmp / "index"
    print(f"indexing {kb_dir / 'corpus.jsonl'} into {index_dir}", flush=True)
    build = build_index(kb_dir / "corpus.jsonl", index_dir, encoder=args.encoder, sparse="bm25")
    questions = load_single_hop(kb_dir, args.max_questions, seed=0)
    print(f"recall on {len(questions)} single-hop questions", flush=True)
    recall = measure_recall(index_dir, questions)
    queries = [q["gold_queries"][0] for q in questions]
    latency = {
        mode: measure_latency(index_dir, mode, queries, args.num_requests)
        for mode in args.latency_modes.split(",")
    }
    served = "hybrid" if "hybrid" in latency else next(iter(latency))
    return {
        **recall,
        "p50_ms": latency[served]["1"]["p50_ms"],
        "p95_ms": latency[served]["1"]["p95_ms"],
        "latency_mode": served,
        "latency": latency,
        "passages_per_s": build["passages_per_s"],
        "build": build,
        "num_questions": len(questions),
        "kb": str(kb_dir),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        result = {**run(args, Path(tmp)), **info}
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("recall_at_3", "p50_ms", "p95_ms", "passages_per_s")}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
