"""`tandem index build`: encode a wiki-18 style corpus (`{"id", "contents"}` jsonl) into a Qdrant index.

Invariant: the index directory's `index.json` is written before the first vector and names the encoder
and BM25 statistics, so an interrupted build can be resumed: a re-run with the same settings skips every
passage whose (deterministic) point id is already stored, and a re-run with other settings is refused
instead of mixing two encoders in one collection.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tandemrl.retrieval import bm25
from tandemrl.retrieval.retriever import IndexMeta
from tandemrl.retrieval.store import QdrantStore, point_id

log = logging.getLogger(__name__)


def read_corpus(path: Path) -> Iterator[dict]:
    """Corpus records with a string `id` and `contents`; a record with `title`/`text` instead gets the
    wiki-18 `contents` ("\\"Title\\"\\ntext"), a record without `id` gets its line number."""
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no + 1}: not valid JSON ({error.msg}).") from error
            if "contents" not in record:
                if "title" not in record or "text" not in record:
                    raise ValueError(
                        f"{path}:{line_no + 1}: a corpus record needs 'contents' (or 'title' and "
                        '\'text\'), as in wiki-18\'s {"id", "contents"} jsonl.'
                    )
                record["contents"] = f'"{record["title"]}"\n{record["text"]}'
            record["id"] = str(record.get("id", line_no))
            yield record


def _batches(records: Iterator[dict], batch_size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for record in records:
        batch.append(record)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _open_meta(
    index_dir: Path, corpus: Path, encoder: str, dim: int, sparse: str | None, qdrant_url: str | None
) -> IndexMeta:
    """The existing metadata when settings match, new metadata (with BM25's avgdl measured) otherwise."""
    if (index_dir / "index.json").is_file():
        meta = IndexMeta.load(index_dir)
        if meta.encoder != encoder or meta.sparse != sparse:
            raise ValueError(
                f"the index at {index_dir} was built with --encoder {meta.encoder} --sparse {meta.sparse}, not "
                f"--encoder {encoder} --sparse {sparse}. Use the same settings to resume it, or a new --index dir."
            )
        return meta
    params = {}
    if sparse == "bm25":
        params = {
            "k1": 1.2,
            "b": 0.75,
            "avgdl": bm25.mean_length(record["contents"] for record in read_corpus(corpus)),
        }
    return IndexMeta(encoder=encoder, dim=dim, sparse=sparse, bm25=params, qdrant_url=qdrant_url)


def build_index(
    corpus: Path,
    index_dir: Path,
    encoder: str = "minilm",
    sparse: str | None = None,
    qdrant_url: str | None = None,
    batch_size: int = 256,
    device: str | None = None,
    show_progress: bool = True,
) -> dict:
    """Index (or finish indexing) `corpus` into `index_dir`; returns the build statistics."""
    from tandemrl.retrieval.encoders import Encoder

    corpus, index_dir = Path(corpus), Path(index_dir)
    _check_inputs(corpus, sparse, batch_size)
    index_dir.mkdir(parents=True, exist_ok=True)
    model = Encoder.from_name(encoder, device=device, batch_size=min(batch_size, 128))
    meta = _open_meta(index_dir, corpus, encoder, model.dim, sparse, qdrant_url)
    store = QdrantStore(index_dir, qdrant_url, meta.collection)
    try:
        if not store.exists():
            store.create(meta.dim, has_sparse=sparse == "bm25")
        meta.save(index_dir)
        stats = _index_batches(corpus, store, model, meta, batch_size, show_progress)
        meta.num_passages = store.count()
        meta.save(index_dir)
    finally:
        store.close()
    stats.update(num_in_index=meta.num_passages, index_dir=str(index_dir), encoder=encoder, sparse=sparse)
    log.info(
        "indexed %d new passages (%d already there) at %.1f passages/s; %d in the index",
        stats["num_indexed"],
        stats["num_skipped"],
        stats["passages_per_s"],
        meta.num_passages,
    )
    return stats


def _check_inputs(corpus: Path, sparse: str | None, batch_size: int) -> None:
    if not corpus.is_file():
        raise FileNotFoundError(f'corpus {corpus} not found (expected a jsonl of {{"id", "contents"}}).')
    if sparse not in (None, "bm25"):
        raise ValueError(f"sparse={sparse!r}: the only sparse vectors supported are 'bm25' (or None).")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size}: must be > 0.")


def _index_batches(
    corpus: Path, store: QdrantStore, model, meta: IndexMeta, batch_size: int, show_progress: bool
) -> dict:
    from tqdm import tqdm

    num_total = sum(1 for _ in read_corpus(corpus))
    progress = tqdm(total=num_total, unit="passage", desc="indexing", disable=not show_progress)
    params = meta.bm25_params() if meta.sparse == "bm25" else None
    num_indexed = num_skipped = 0
    start = time.perf_counter()
    with progress:
        for batch in _batches(read_corpus(corpus), batch_size):
            ids = [point_id(record["id"]) for record in batch]
            stored = store.existing(ids)
            new = [(pid, record) for pid, record in zip(ids, batch, strict=True) if pid not in stored]
            num_skipped += len(batch) - len(new)
            if new:
                texts = [record["contents"] for _, record in new]
                sparse = [bm25.passage_vector(text, params) for text in texts] if params else None
                store.upsert(
                    [pid for pid, _ in new],
                    [record for _, record in new],
                    model.encode_passages(texts),
                    sparse,
                )
                num_indexed += len(new)
            progress.update(len(batch))
            progress.set_postfix(new=num_indexed, skipped=num_skipped, refresh=False)
    seconds = time.perf_counter() - start
    return {
        "num_passages": num_total,
        "num_indexed": num_indexed,
        "num_skipped": num_skipped,
        "seconds": round(seconds, 3),
        "passages_per_s": round(num_indexed / seconds, 1) if num_indexed else 0.0,
    }


def run_build(args) -> int:
    try:
        stats = build_index(
            Path(args.corpus),
            Path(args.index),
            encoder=args.encoder,
            sparse=args.sparse,
            qdrant_url=args.qdrant_url,
            batch_size=args.batch_size,
        )
    except ValueError as error:
        print(f"tandem index build: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2))
    return 0
