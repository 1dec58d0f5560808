"""`tandem prepare model|retriever|kb|all`: put the embedded defaults in place under `$TANDEM_HOME`.

`all` = model + retriever + the default knowledge base (seed 0) + its dense index, each step
idempotent: a prepared model/retriever carries a ready marker, a complete KB is kept, and the index
builder leaves an index built from the same corpus file by the same BM25 tokenizer alone (and resumes an
interrupted build), so a re-run only finishes what is missing.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from tandemrl.data.prepare_model import prepare_model, prepare_retriever
from tandemrl.host.home import default_index_dir, default_kb_dir

log = logging.getLogger(__name__)


def run_prepare_model(args) -> int:
    print(f"model: {prepare_model()}")
    return 0


def run_prepare_retriever(args) -> int:
    print(f"retriever: {prepare_retriever()}")
    return 0


def prepare_kb(
    out_dir: str | Path, seed: int = 0, num_entities: int = 5000, is_partial_ok: bool = False
) -> dict:
    """Generate a KB and return its sizes and the generation time (`generate_kb` says which folders it
    refuses)."""
    from tandemrl.data.kb import generate_kb

    start = time.perf_counter()
    out_dir = generate_kb(out_dir, seed=seed, num_entities=num_entities, is_partial_ok=is_partial_ok)
    seconds = time.perf_counter() - start
    meta = json.loads((out_dir / "kb_meta.json").read_text())
    meta.update(
        out_dir=str(out_dir),
        seconds=round(seconds, 2),
        num_bytes={p.name: p.stat().st_size for p in sorted(out_dir.glob("*.jsonl"))},
    )
    return meta


def run_prepare_kb(args) -> int:
    """`--out` must be a new or empty folder, or one an earlier `tandem prepare kb` wrote (data/kb.py)."""
    try:
        if not args.out.strip():  # Path("") is the working directory: never a place chosen on purpose
            raise ValueError("--out is empty; pass the folder to write the knowledge base to, e.g. --out kb.")
        stats = prepare_kb(args.out, seed=args.seed, num_entities=args.num_entities)
    except ValueError as error:
        print(f"tandem prepare kb: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a parent that is a file, no permission, a full disk
        where = f" ({error.filename})" if error.filename else ""
        print(
            f"tandem prepare kb: cannot write --out {args.out!r}: {error.strerror or error}{where}.",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(stats, indent=2))
    return 0


def prepare_default_kb() -> Path:
    """The default KB (seed 0) at `default_kb_dir()`, generated unless already complete."""
    from tandemrl.data.kb import kb_is_complete

    kb_dir = default_kb_dir()
    if kb_is_complete(kb_dir):
        log.info("knowledge base already at %s", kb_dir)
        return kb_dir
    stats = prepare_kb(kb_dir, seed=0, is_partial_ok=True)  # the folder is ours: an interrupted KB is redone
    log.info(
        "knowledge base generated in %.1f s: %d passages, questions %s",
        stats["seconds"],
        stats["num_passages"],
        stats["num_questions"],
    )
    return kb_dir


def prepare_default_index(kb_dir: Path) -> Path:
    """The MiniLM dense + BM25 sparse index of the default KB's corpus at `default_index_dir()`.

    The builder records the corpus digest and the BM25 tokenizer's version in the index: an index of this
    very corpus by this tokenizer is kept, any other is rebuilt whole and swapped in (retrieval/build.py)."""
    from tandemrl.retrieval.build import build_index

    index_dir = default_index_dir()
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    # "minilm" resolves to prepare_retriever()'s directory and matches retrieval.encoder's default;
    # BM25 next to the dense vectors makes hybrid search (the served default) possible: recall@3 0.970
    # against 0.943 for dense alone on the KB's test split (benchmarks/retrieval/retrieval.py, docs/RETRIEVAL.md)
    stats = build_index(kb_dir / "corpus.jsonl", index_dir, encoder="minilm", sparse="bm25")
    log.info("index at %s: %s", index_dir, stats)
    return index_dir


def run_prepare_all(args) -> int:
    model_dir = prepare_model()
    retriever_dir = prepare_retriever()
    kb_dir = prepare_default_kb()
    index_dir = prepare_default_index(kb_dir)
    print(
        json.dumps(
            {
                "model": str(model_dir),
                "retriever": str(retriever_dir),
                "kb": str(kb_dir),
                "index": str(index_dir),
            },
            indent=2,
        )
    )
    return 0
