"""Retrieval benchmark: recall@1/@3/@10 of the gold passage per mode and search latency per batch, on any
Search-R1-format corpus and questions, or on the generated knowledge base.

    python -m benchmarks.retrieval.retrieval --corpus C --questions Q [Q2 ...] [--index DIR] [--out FILE]
    python -m benchmarks.retrieval.retrieval --kb [DIR|default] [--index DIR] [--server-latency]

The corpus is a jsonl of `{"id", "contents": "\\"Title\\"\\ntext"}` (wiki-18's format); a question file is a
jsonl of `{"question", "gold_passage_ids": [...]}` (the knowledge base's format); a hit is a question
with any gold id among the top k. `--kb` turns each KB split into such files: one row per hop, with the
hop's gold query (what a policy searches for) as the question, plus the raw single-hop questions. Modes:
`dense`, `bm25`, `hybrid` (the default fusion, see tandemrl/retrieval/fusion.py) and `hybrid_rrf` (the
previous default, plain RRF). Latency is the wall time of one in-process `Retriever.search` call on a
batch of `--batch-size` queries; `--server-latency` also times the real HTTP server, one query a request.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks import write_json  # noqa: E402
from tandemrl.retrieval.build import build_index  # noqa: E402
from tandemrl.retrieval.fusion import FusionParams, default_fusion  # noqa: E402
from tandemrl.retrieval.retriever import Retriever  # noqa: E402

KS = (1, 3, 10)
MODES = {  # reported name -> (retriever mode, fusion)
    "dense": ("dense", FusionParams()),
    "bm25": ("bm25", FusionParams()),
    "hybrid": ("hybrid", FusionParams()),
    "hybrid_rrf": ("hybrid", default_fusion("rrf")),
}


def load_questions(path: Path, max_questions: int | None = None) -> list[dict]:
    """`{"question", "gold_passage_ids"}` rows; a row without them is an error naming file and line."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({error.msg}).") from error
            gold = row.get("gold_passage_ids") if isinstance(row, dict) else None
            if not isinstance(row.get("question"), str) or not isinstance(gold, list) or not gold:
                raise ValueError(
                    f'{path}:{line_no}: a question row needs "question" (a string) and "gold_passage_ids" '
                    "(a non-empty list of corpus ids)."
                )
            rows.append({"question": row["question"], "gold": {str(g) for g in gold}})
    if not rows:
        raise ValueError(f"{path}: no questions.")
    return rows[:max_questions] if max_questions else rows


def kb_question_files(kb_dir: Path, out_dir: Path) -> list[Path]:
    """The KB's val (dev) and test splits as question files: per-hop gold queries, raw 1-hop questions."""
    paths = []
    for split, name in (("val", "kb_dev"), ("test", "kb_test")):
        rows = [json.loads(line) for line in open(kb_dir / f"{split}.jsonl", encoding="utf-8")]
        hops = [
            {"question": query, "gold_passage_ids": [gold]}
            for row in rows
            for query, gold in zip(row["gold_queries"], row["gold_passage_ids"], strict=True)
        ]
        raw = [
            {"question": row["question"], "gold_passage_ids": row["gold_passage_ids"][:1]}
            for row in rows
            if row["data_source"] == "kb_1hop"
        ]
        for suffix, items in (("", hops), ("_questions", raw)):
            path = out_dir / f"{name}{suffix}.jsonl"
            path.write_text("".join(json.dumps(item) + "\n" for item in items))
            paths.append(path)
    return paths


def percentile_ms(seconds: list[float], q: int) -> float:
    if len(seconds) == 1:
        return round(seconds[0] * 1000, 2)
    return round(statistics.quantiles(seconds, n=100, method="inclusive")[q - 1] * 1000, 2)


def evaluate(retriever: Retriever, questions: list[dict], batch_size: int) -> dict:
    """Recall@k and per-batch latency for every mode in MODES, from one top-10 search per question."""
    out = {}
    for name, (mode, fusion) in MODES.items():
        retriever.fusion = fusion
        hits = dict.fromkeys(KS, 0)
        batch_s = []
        for offset in range(0, len(questions), batch_size):
            batch = questions[offset : offset + batch_size]
            start = time.perf_counter()
            results = retriever.search([q["question"] for q in batch], [max(KS)] * len(batch), mode=mode)
            batch_s.append(time.perf_counter() - start)
            for question, ranked in zip(batch, results, strict=True):
                ids = [hit.document["id"] for hit in ranked]
                for k in KS:
                    hits[k] += bool(question["gold"] & set(ids[:k]))
        out[name] = {
            **{f"recall_at_{k}": round(hits[k] / len(questions), 4) for k in KS},
            "batch_p50_ms": percentile_ms(batch_s, 50),
            "batch_p95_ms": percentile_ms(batch_s, 95),
        }
        print(
            f"  {name:10s} "
            + "  ".join(f"R@{k} {out[name][f'recall_at_{k}']:.3f}" for k in KS)
            + f"  batch of {batch_size}: p50 {out[name]['batch_p50_ms']:.1f} ms, "
            f"p95 {out[name]['batch_p95_ms']:.1f} ms",
            flush=True,
        )
    retriever.fusion = FusionParams()
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
    parser.add_argument("--corpus", help="Search-R1-format corpus jsonl")
    parser.add_argument("--questions", nargs="+", default=[], help="question jsonl file(s)")
    parser.add_argument(
        "--kb",
        nargs="?",
        const="generate",
        help="benchmark a knowledge base: a KB dir, 'default' ($TANDEM_HOME's prepared KB), or no value "
        "to generate the seed-0 KB afresh",
    )
    parser.add_argument("--index", help="index dir to build into or reuse (default: a fresh temp dir)")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--batch-size", type=int, default=32, help="queries per search call")
    parser.add_argument("--max-questions", type=int, default=None, help="per question file")
    parser.add_argument("--provenance", help="a JSON file (licence, source) copied into the results")
    parser.add_argument("--server-latency", action="store_true", help="also time the HTTP server")
    parser.add_argument("--num-requests", type=int, default=200, help="requests per server latency run")
    parser.add_argument(
        "--server-threads",
        default="0,4",
        help="comma-separated sizes of the server's thread pools to time (0: one thread per core)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results JSON (default: benchmarks/results/retrieval/retrieval_<corpus>.json)",
    )
    args = parser.parse_args(argv)
    if (args.kb is None) == (args.corpus is None):
        parser.error("give either --corpus C --questions Q [Q ...] or --kb [DIR|default].")
    if args.corpus and not args.questions:
        parser.error("--corpus needs --questions Q [Q ...].")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: must be >= 1.")
    return args


def resolve_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, list[Path], str]:
    """(corpus, question files, name) from --corpus/--questions or --kb."""
    if args.corpus:
        return Path(args.corpus), [Path(q) for q in args.questions], Path(args.corpus).parent.name
    from tandemrl.host.home import default_kb_dir

    if args.kb == "generate":
        from tandemrl.data.kb import generate_kb

        print(f"generating the default knowledge base (seed 0) in {tmp / 'kb'}", flush=True)
        kb_dir = generate_kb(tmp / "kb", seed=0)
    else:
        kb_dir = default_kb_dir() if args.kb == "default" else Path(args.kb)
    return kb_dir / "corpus.jsonl", kb_question_files(kb_dir, tmp), "kb"


def run(args: argparse.Namespace, tmp: Path) -> dict:
    corpus, question_files, name = resolve_inputs(args, tmp)
    index_dir = Path(args.index) if args.index else tmp / "index"
    print(f"indexing {corpus} into {index_dir}", flush=True)
    build = build_index(corpus, index_dir, encoder=args.encoder, sparse="bm25", show_progress=False)
    retriever = Retriever(index_dir, mode="hybrid")
    results: dict[str, dict] = {}
    try:
        for path in question_files:
            questions = load_questions(path, args.max_questions)
            print(
                f"{path.stem}: {len(questions)} questions over {retriever.num_passages} passages", flush=True
            )
            results[path.stem] = {
                "num_questions": len(questions),
                **evaluate(retriever, questions, args.batch_size),
            }
    finally:
        retriever.close()
    out = {"name": name, "corpus": str(corpus), "encoder": args.encoder, "batch_size": args.batch_size}
    out.update(results=results, default_fusion=vars(FusionParams()), build=build)
    if args.server_latency:
        from benchmarks.retrieval.retrieval_latency import measure_latency

        queries = [q["question"] for q in load_questions(question_files[0], args.max_questions)]
        threads = tuple(int(n) for n in args.server_threads.split(","))
        out["server_latency"] = measure_latency(index_dir, "hybrid", queries, args.num_requests, threads)
    if args.provenance:
        out["provenance"] = json.loads(Path(args.provenance).read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine()}
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
            result = {**run(args, Path(tmp)), **info}
    except (ValueError, FileNotFoundError) as error:
        print(f"benchmarks/retrieval/retrieval.py: {error}", file=sys.stderr)
        return 2
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    write_json(args.out or f"benchmarks/results/retrieval/retrieval_{result['name']}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
