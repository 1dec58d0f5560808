"""Does `agentloop.max_info_tokens` keep the answer in the information block? On the generated KB and on
real text, for each question: search with the default retriever (top `--topk`), render the block the
agent loop would insert (tandemrl/agent/prompt.py `format_information`) under each budget, and check
whether a gold answer (normalised as the reward does) is still in it.

    python -m benchmarks.retrieval.info_budget --kb default [--realtext DIR] [--budgets 160,256,384,512]

`--kb` takes a KB dir or 'default' ($TANDEM_HOME's prepared KB); each hop of each val question is one
row (its gold query, its hop answer). `--realtext` takes the directory `benchmarks/retrieval/realtext_data.py`
writes (corpus.jsonl, dev.jsonl: FanOutQA questions over Wikipedia summaries); its dev questions are
searched as asked. Prints a table and writes benchmarks/results/retrieval/info_budget.json (or `--out`).

Reads: `answer_in_block` is the share of rows whose block holds an answer under that budget;
`kept` divides it by the share with no budget, i.e. how much of what retrieval found the cut keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks import write_json  # noqa: E402
from tandemrl.agent.prompt import encode_text, format_information  # noqa: E402
from tandemrl.agent.reward import normalize_answer  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "retrieval"


def kb_rows(kb_dir: Path, max_rows: int | None) -> list[dict]:
    """One row per hop of each val question: what a policy searches for, and what that hop answers."""
    rows = []
    for line in open(kb_dir / "val.jsonl", encoding="utf-8"):
        item = json.loads(line)
        for hop, (query, answer) in enumerate(zip(item["gold_queries"], item["hop_answers"], strict=True)):
            rows.append({"query": query, "answers": [answer], "kind": f"{item['data_source']}_hop{hop + 1}"})
    return rows[:max_rows] if max_rows else rows


def realtext_rows(data_dir: Path, max_rows: int | None) -> list[dict]:
    rows = []
    for line in open(data_dir / "dev.jsonl", encoding="utf-8"):
        item = json.loads(line)
        rows.append({"query": item["question"], "answers": item["golden_answers"], "kind": "realtext"})
    return rows[:max_rows] if max_rows else rows


def has_answer(block: str, answers: list[str]) -> bool:
    text = normalize_answer(block)
    return any(normalize_answer(answer) and normalize_answer(answer) in text for answer in answers)


def check_rows(
    name: str, corpus: Path, index_dir: Path, rows: list[dict], budgets: list[int], topk: int, tokenizer
) -> list[dict]:
    """Search every row once; per row its uncapped block's tokens and, per budget ("none" included),
    whether an answer is in the block."""
    from tandemrl.retrieval.build import build_index
    from tandemrl.retrieval.retriever import Retriever

    if not (index_dir / "index.json").exists():
        print(f"{name}: indexing {corpus} into {index_dir}", flush=True)
        build_index(corpus, index_dir, encoder="minilm", sparse="bm25", show_progress=False)
    retriever = Retriever(index_dir)
    try:
        hits = []
        for offset in range(0, len(rows), 64):
            batch = rows[offset : offset + 64]
            hits += retriever.search([row["query"] for row in batch], [topk] * len(batch))
    finally:
        retriever.close()
    checked = []
    for row, ranked in zip(rows, hits, strict=True):
        docs = [{"document": hit.document, "score": hit.score} for hit in ranked]
        whole = format_information(docs)
        found = {"none": has_answer(whole, row["answers"])}
        for budget in budgets:
            found[str(budget)] = has_answer(format_information(docs, tokenizer, budget), row["answers"])
        checked.append({"kind": row["kind"], "tokens": len(encode_text(tokenizer, whole)), "found": found})
    return checked


def summarize(name: str, checked: list[dict], budgets: list[int], topk: int) -> dict:
    n = len(checked)
    whole_tokens = [row["tokens"] for row in checked]
    found = {key: sum(row["found"][key] for row in checked) for key in ["none", *map(str, budgets)]}
    out = {
        "rows": n,
        "topk": topk,
        "block_tokens_uncapped": {
            "p50": statistics.median(whole_tokens),
            "p90": statistics.quantiles(whole_tokens, n=10)[-1] if n > 1 else whole_tokens[0],
            "max": max(whole_tokens),
        },
        "answer_in_block": {key: round(count / n, 4) for key, count in found.items()},
        "kept": {
            key: round(count / found["none"], 4) if found["none"] else None
            for key, count in found.items()
            if key != "none"
        },
    }
    print(
        f"{name}: {n} rows, uncapped block p50 {out['block_tokens_uncapped']['p50']:.0f} / p90 "
        f"{out['block_tokens_uncapped']['p90']:.0f} / max {out['block_tokens_uncapped']['max']} tokens; "
        f"answer in block: no budget {out['answer_in_block']['none']:.3f}, "
        + ", ".join(
            f"{budget}: {out['answer_in_block'][str(budget)]:.3f} (kept {out['kept'][str(budget)]:.3f})"
            for budget in budgets
        ),
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kb", help="a KB dir, or 'default' for $TANDEM_HOME's prepared KB")
    parser.add_argument("--realtext", help="the directory benchmarks/retrieval/realtext_data.py wrote")
    parser.add_argument(
        "--budgets", default="160,256,384,512", help="max_info_tokens values, comma-separated"
    )
    parser.add_argument("--topk", type=int, default=3, help="passages per search (tools.search.topk)")
    parser.add_argument("--max-rows", type=int, default=None, help="per dataset")
    parser.add_argument("--tokenizer", help="model dir (default: $TANDEM_HOME's SmolLM2)")
    parser.add_argument(
        "--kb-index", help="the KB's index (default: $TANDEM_HOME's for --kb default, else built)"
    )
    parser.add_argument("--realtext-index", help="the real-text index to reuse or build (default: built)")
    parser.add_argument("--out", default=str(RESULTS / "info_budget.json"))
    args = parser.parse_args(argv)
    if not args.kb and not args.realtext:
        parser.error("give --kb, --realtext or both.")
    try:
        budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        parser.error(f"--budgets {args.budgets!r}: comma-separated integers, e.g. 160,256,384")
    if not budgets or budgets[0] < 16:
        parser.error(f"--budgets {args.budgets!r}: each budget must be >= 16 tokens.")
    from transformers import AutoTokenizer

    from tandemrl.host.home import default_index_dir, default_kb_dir, default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_dir())
    results = {
        "command": "benchmarks/retrieval/info_budget.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "budgets": budgets,
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.kb:
            kb_dir = default_kb_dir() if args.kb == "default" else Path(args.kb)
            rows = kb_rows(kb_dir, args.max_rows)
            kb_index = Path(
                args.kb_index or (default_index_dir() if args.kb == "default" else Path(tmp) / "kb")
            )
            checked = check_rows("kb", kb_dir / "corpus.jsonl", kb_index, rows, budgets, args.topk, tokenizer)
            results["kb"] = summarize("kb", checked, budgets, args.topk)
            for kind in sorted({row["kind"] for row in checked}):
                subset = [row for row in checked if row["kind"] == kind]
                results[f"kb:{kind}"] = summarize(f"kb:{kind}", subset, budgets, args.topk)
        if args.realtext:
            data_dir = Path(args.realtext)
            rows = realtext_rows(data_dir, args.max_rows)
            index = Path(args.realtext_index or Path(tmp) / "realtext")
            checked = check_rows(
                "realtext", data_dir / "corpus.jsonl", index, rows, budgets, args.topk, tokenizer
            )
            results["realtext"] = summarize("realtext", checked, budgets, args.topk)
            provenance = data_dir / "provenance.json"
            if provenance.exists():
                results["realtext_provenance"] = json.loads(provenance.read_text())
    write_json(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
