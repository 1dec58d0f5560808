"""`tandem index build`: encode a wiki-18 style corpus (`{"id", "contents"}` jsonl) into a Qdrant index.

Invariant: a build is all or nothing. The corpus is checked whole first (retrieval/corpus.py: every
record valid, ids unique and present, or all absent and numbered by line), then encoded into a staging
directory beside the index (`.<name>.building`), which is moved in only once the count of indexed
passages equals the corpus's. A failed or interrupted build therefore leaves whatever was at `--index`
before; a rebuild replaces the old contents whole. The staging directory of an interrupted build (Ctrl-C,
a kill) is resumed by the same command with the same corpus file and settings (its `index.json`, written
before the first vector, names the corpus digest, the encoder, BM25's statistics and tokenizer version);
with anything else it is discarded, and a build that fails removes it. An index already built from the
same file with the same settings and BM25 tokenizer is left as it is.

Since the swap replaces `--index` whole, it may only replace a directory that holds nothing but what a
build writes there (`index.json`, `qdrant/`); anything else, the corpus itself included, is refused
before the encoder loads, as is an `--index` beside which the staging directory cannot be made.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tandemrl.retrieval import bm25
from tandemrl.retrieval.corpus import CorpusScan, read_corpus, scan_corpus
from tandemrl.retrieval.index_place import check_index_place, is_within, refuse_foreign_entries, staging_dir
from tandemrl.retrieval.retriever import META_FILE, IndexMeta
from tandemrl.retrieval.store import COLLECTION, QdrantStore, point_id

log = logging.getLogger(__name__)

__all__ = ["build_index", "read_corpus", "run_build"]


def _batches(records: Iterator[dict], batch_size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for record in records:
        batch.append(record)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


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
    """Index `corpus` into `index_dir` whole (replacing what is there); returns the build statistics."""
    from tandemrl.retrieval.encoders import Encoder

    corpus, index_dir = Path(corpus), Path(index_dir)
    _check_inputs(corpus, index_dir, sparse, batch_size)
    scan = scan_corpus(corpus)  # every record checked before anything is encoded
    log.info("corpus %s: %d passages, ids unique", corpus, scan.num_passages)
    if sparse == "bm25" and scan.mean_length <= 0:
        raise ValueError(
            f"corpus {corpus}: no record has a word BM25 can index (letters or digits), so BM25 has nothing "
            "to score. Build without --sparse bm25, or check that it is the corpus you meant."
        )
    current = _built_from(index_dir, scan, encoder, sparse, qdrant_url)
    if current is not None:
        return _stats(scan, current, 0, 0.0, index_dir, encoder, sparse, num_skipped=scan.num_passages)
    model = Encoder.from_name(encoder, device=device, batch_size=min(batch_size, 128))
    staging = staging_dir(index_dir)
    try:
        meta = _open_staging(staging, scan, encoder, model.dim, sparse, qdrant_url)
        num_indexed, num_skipped, seconds = _fill(
            staging, corpus, meta, model, scan, batch_size, show_progress
        )
        _swap_in(staging, index_dir, qdrant_url)
    except Exception:  # a failed build leaves nothing behind; an interrupted one stays to be resumed
        shutil.rmtree(staging, ignore_errors=True)
        raise
    stats = _stats(scan, meta, num_indexed, seconds, index_dir, encoder, sparse, num_skipped)
    log.info("indexed %d passages (%d resumed); %d in the index", num_indexed, num_skipped, meta.num_passages)
    return stats


def _fill(
    staging: Path,
    corpus: Path,
    meta: IndexMeta,
    model,
    scan: CorpusScan,
    batch_size: int,
    show_progress: bool,
) -> tuple[int, int, float]:
    """Index every passage into the staging directory and record the count in its `index.json`:
    (passages encoded now, passages resumed, seconds)."""
    store = QdrantStore(staging, meta.qdrant_url, meta.collection)
    try:
        if not store.exists():
            store.create(meta.dim, has_sparse=meta.sparse == "bm25")
        start = time.perf_counter()
        num_indexed, num_skipped = _index_batches(corpus, store, model, meta, scan, batch_size, show_progress)
        seconds = time.perf_counter() - start
        num_in_store = store.count()
    finally:
        store.close()
    if num_in_store != scan.num_passages:  # never moved in: the old index stays
        raise ValueError(
            f"indexed {num_in_store} passages but the corpus {corpus} has {scan.num_passages}; the index was "
            "left as it was. Rebuild it."
        )
    meta.num_passages = num_in_store
    meta.save(staging)
    return num_indexed, num_skipped, seconds


def _stats(
    scan: CorpusScan,
    meta: IndexMeta,
    num_indexed: int,
    seconds: float,
    index_dir: Path,
    encoder: str,
    sparse: str | None,
    num_skipped: int,
) -> dict:
    return {
        "num_passages": scan.num_passages,
        "num_indexed": num_indexed,
        "num_skipped": num_skipped,
        "seconds": round(seconds, 3),
        "passages_per_s": round(num_indexed / seconds, 1) if num_indexed and seconds > 0 else 0.0,
        "num_in_index": meta.num_passages,
        "index_dir": str(index_dir),
        "encoder": encoder,
        "sparse": sparse,
    }


def _check_inputs(corpus: Path, index_dir: Path, sparse: str | None, batch_size: int) -> None:
    if sparse not in (None, "bm25"):
        raise ValueError(f"sparse={sparse!r}: the only sparse vectors supported are 'bm25' (or None).")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size}: must be > 0.")
    try:
        corpus.stat()
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise FileNotFoundError(
                f"corpus {corpus} is a symbolic link that loops; point at the jsonl file."
            ) from None
        raise FileNotFoundError(
            f'corpus {corpus} not found (expected a jsonl of {{"id", "contents"}}).'
        ) from None
    if not corpus.is_file():
        raise ValueError(f'corpus {corpus} is not a file (expected a jsonl of {{"id", "contents"}}).')
    check_index_place(index_dir)
    staging = staging_dir(index_dir)
    for replaced in (index_dir, staging):  # both are removed whole by a build
        if is_within(corpus, replaced):
            raise ValueError(
                f"corpus {corpus} is inside {replaced}, which the build replaces whole: the corpus would be "
                "lost. Move the corpus out of it, or choose another --index (a new or empty folder)."
            )
    refuse_foreign_entries(index_dir)
    refuse_foreign_entries(staging, f"the staging folder of --index {index_dir},")


def _meta_matches(
    meta: IndexMeta, scan: CorpusScan, encoder: str, sparse: str | None, url: str | None
) -> bool:
    """Built (or being built) from this corpus with these settings; BM25 vectors also by this tokenizer (an
    older one's index still serves, its queries tokenized as it was built: `tandem index build` replaces
    it, so its Chinese and Japanese passages match by character)."""
    is_same_tokenizer = sparse != "bm25" or meta.bm25_tokenizer == bm25.TOKENIZER_VERSION
    return is_same_tokenizer and (meta.corpus_sha256, meta.encoder, meta.sparse, meta.qdrant_url) == (
        scan.sha256,
        encoder,
        sparse,
        url,
    )


def _built_from(index_dir: Path, scan: CorpusScan, encoder: str, sparse: str | None, url: str | None):
    """The index's metadata when it is whole and was built from this corpus with these settings. An
    index that a running retrieval server holds open is refused (RuntimeError): replacing it would
    leave that server serving the old passages."""
    try:
        meta = IndexMeta.load(index_dir)
    except (FileNotFoundError, ValueError):
        return None
    store = QdrantStore(index_dir, meta.qdrant_url, meta.collection)  # raises when another process has it
    try:
        matches = _meta_matches(meta, scan, encoder, sparse, url) and meta.num_passages == scan.num_passages
        is_whole = matches and store.exists() and store.count() == scan.num_passages
    finally:
        store.close()
    if is_whole:
        log.info("the index at %s was built from this corpus with these settings; nothing to do", index_dir)
    return meta if is_whole else None


def _open_staging(
    staging: Path, scan: CorpusScan, encoder: str, dim: int, sparse: str | None, url: str | None
):
    """The staging directory's metadata: an interrupted build of the same corpus and settings is
    resumed; anything else there is discarded."""
    try:
        meta = IndexMeta.load(staging)
        if _meta_matches(meta, scan, encoder, sparse, url):
            log.info("resuming the interrupted build in %s", staging)
            return meta
    except (FileNotFoundError, ValueError):
        pass
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    params = {"k1": 1.2, "b": 0.75, "avgdl": scan.mean_length} if sparse == "bm25" else {}
    # a Qdrant server keeps collections of every build side by side until the swap: a fresh name each
    collection = f"{COLLECTION}_{uuid.uuid4().hex[:12]}" if url else COLLECTION
    meta = IndexMeta(encoder, dim, sparse, params, url, collection, corpus_sha256=scan.sha256)
    meta.save(staging)
    return meta


def _swap_in(staging: Path, index_dir: Path, url: str | None) -> None:
    """Put the finished staging directory at `index_dir`; the old index is kept until the new is there."""
    previous = index_dir.parent / f".{index_dir.name}.previous-{os.getpid()}"
    old_meta = None
    if index_dir.is_dir() and (index_dir / META_FILE).is_file():
        try:
            old_meta = IndexMeta.load(index_dir)
        except ValueError:
            pass
    refuse_foreign_entries(index_dir)  # again: something may have been put there while encoding
    if index_dir.is_dir() and not any(index_dir.iterdir()):
        index_dir.rmdir()
    if index_dir.exists():
        os.replace(index_dir, previous)
    try:
        os.replace(staging, index_dir)
    except BaseException:
        if previous.exists() and not index_dir.exists():
            os.replace(previous, index_dir)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    if url and old_meta is not None and old_meta.qdrant_url == url and old_meta.collection != COLLECTION:
        _drop_collection(url, old_meta.collection)


def _drop_collection(url: str, collection: str) -> None:
    store = QdrantStore(None, url, collection)
    try:
        store.client.delete_collection(collection)
    finally:
        store.close()


def _index_batches(
    corpus: Path,
    store: QdrantStore,
    model,
    meta: IndexMeta,
    scan: CorpusScan,
    batch_size: int,
    show_progress: bool,
) -> tuple[int, int]:
    """(passages encoded now, passages already stored by an interrupted build of the same corpus)."""
    from tqdm import tqdm

    progress = tqdm(total=scan.num_passages, unit="passage", desc="indexing", disable=not show_progress)
    params = meta.bm25_params() if meta.sparse == "bm25" else None
    num_indexed = num_skipped = 0
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
            progress.set_postfix(new=num_indexed, resumed=num_skipped, refresh=False)
    return num_indexed, num_skipped


def run_build(args) -> int:
    from tandemrl.retrieval.store import server_errors

    if not args.index:
        print(
            "tandem index build: --index is empty; name the folder for the index, e.g. --index indexes/wiki.",
            file=sys.stderr,
        )
        return 2
    try:
        stats = build_index(
            Path(args.corpus),
            Path(args.index),
            encoder=args.encoder,
            sparse=args.sparse,
            qdrant_url=args.qdrant_url,
            batch_size=args.batch_size,
        )
    except (ValueError, OSError, RuntimeError) as error:  # bad input, a path, an index in use
        print(f"tandem index build: {error}", file=sys.stderr)
        return 2
    except server_errors() as error:
        print(f"tandem index build: the Qdrant server at {args.qdrant_url} failed: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2))
    print(
        f"tandem index build: {stats['num_in_index']} passages in {stats['index_dir']}, as many as the "
        f"corpus has ({stats['num_passages']})",
        file=sys.stderr,
    )
    return 0
