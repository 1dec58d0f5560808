"""Search over a built index: the index metadata, and `Retriever` = encoder + BM25 + Qdrant store.

Invariant: everything needed to search an index the way it was built (encoder spec, BM25 parameters
and tokenizer version, where the vectors live) is read from `index.json` in the index directory, written
by the builder; the server and the benchmark never take those settings from anywhere else.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tandemrl.host.startup import mark
from tandemrl.retrieval import bm25
from tandemrl.retrieval.bm25 import TOKENIZER_VERSION
from tandemrl.retrieval.fusion import FusionParams
from tandemrl.retrieval.store import MODES, Hit, QdrantStore

log = logging.getLogger(__name__)

META_FILE = "index.json"
META_FORMAT = 1


@dataclass
class IndexMeta:
    encoder: str
    dim: int
    sparse: str | None = None  # "bm25" or None
    bm25: dict = field(default_factory=dict)  # BM25Params fields
    qdrant_url: str | None = None
    collection: str = "passages"
    num_passages: int = 0
    format: int = META_FORMAT
    corpus_sha256: str | None = None  # of the corpus file it was built from (None: an older build)
    # bm25.TOKENIZER_VERSION of the BM25 vectors; an index.json without it was written by version 1
    bm25_tokenizer: int = TOKENIZER_VERSION

    @classmethod
    def load(cls, index_dir: Path) -> IndexMeta:
        path = Path(index_dir) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {index_dir} is not a built index. "
                f"Build it with `tandem index build --corpus CORPUS --index {index_dir}`."
            )
        from tandemrl.host.files import read_text

        try:  # bounded: an index description is a few hundred bytes
            data = json.loads(read_text(path, "index description", 1 << 20))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} cannot be read as JSON ({error}); rebuild the index.") from None
        if not isinstance(data, dict) or data.get("format") != META_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: index format {found} is not {META_FORMAT}; rebuild the index.")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{"bm25_tokenizer": 1, **{key: value for key, value in data.items() if key in names}})
        except TypeError as error:
            raise ValueError(f"{path} is not an index description ({error}); rebuild the index.") from None

    def save(self, index_dir: Path) -> None:
        path = Path(index_dir) / META_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)  # atomic: a reader never sees half a file

    def bm25_params(self) -> bm25.BM25Params:
        return bm25.BM25Params(**self.bm25)


def default_mode(meta: IndexMeta) -> str:
    return "hybrid" if meta.sparse == "bm25" else "dense"


class Retriever:
    """Batch search in one of `dense | bm25 | hybrid`; not thread-safe (call it from one thread).

    `in_memory` (default: on for local mode, off for a Qdrant server) searches a `MemoryIndex` loaded
    from the collection instead of asking Qdrant, whose local mode is too slow past a few thousand points.
    """

    def __init__(
        self,
        index_dir: Path,
        mode: str | None = None,
        qdrant_url: str | None = None,
        device: str | None = None,
        fusion: FusionParams = FusionParams(),
        in_memory: bool | None = None,
    ):
        self.index_dir = Path(index_dir)
        self.meta = IndexMeta.load(self.index_dir)
        self.mode = mode or default_mode(self.meta)
        self.encoder = None
        self._check_mode(self.mode, need_encoder=False)
        self.fusion = fusion
        self.store = QdrantStore(self.index_dir, qdrant_url or self.meta.qdrant_url, self.meta.collection)
        mark("retrieval: Qdrant index opened")
        self.num_passages = self.store.count()
        if self.num_passages == 0 or self.num_passages != self.meta.num_passages:
            self.store.close()
            raise ValueError(
                f"the index at {self.index_dir} holds {self.num_passages} passages but index.json records "
                f"{self.meta.num_passages}: it is {'empty' if self.num_passages == 0 else 'incomplete'}. "
                f"Rebuild it with `tandem index build --corpus CORPUS --index {self.index_dir}`."
            )
        if self.mode != "bm25":
            from tandemrl.retrieval.encoders import Encoder

            self.encoder = Encoder.from_name(self.meta.encoder, device=device)
            mark("retrieval: encoder loaded")
        self.memory = None
        if in_memory if in_memory is not None else self.store.is_local:
            from tandemrl.retrieval.memory import MemoryIndex

            self.memory = MemoryIndex.from_store(self.store)
            mark("retrieval: vectors loaded into memory")
        log.info("retriever on %s: mode %s, %d passages", self.store.location, self.mode, self.num_passages)

    def _check_mode(self, mode: str, need_encoder: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"retrieval mode {mode!r} is not one of {', '.join(MODES)}.")
        if mode != "dense" and self.meta.sparse != "bm25":
            raise ValueError(
                f"retrieval mode {mode!r} needs BM25 vectors, but the index at {self.index_dir} has "
                "none. Rebuild it with `--sparse bm25` or use mode dense."
            )
        if mode != "dense" and self.meta.bm25_tokenizer not in bm25.TOKENIZER_VERSIONS:
            raise ValueError(
                f"the BM25 vectors of the index at {self.index_dir} were made by tokenizer version "
                f"{self.meta.bm25_tokenizer!r}, which this tandemrl does not know (it knows "
                f"{', '.join(map(str, bm25.TOKENIZER_VERSIONS))}: retrieval/bm25.py). Rebuild it with `tandem "
                f"index build --corpus CORPUS --index {self.index_dir} --sparse bm25`, or use mode dense."
            )
        if need_encoder and mode != "bm25" and self.encoder is None:
            raise ValueError(
                f"retrieval mode {mode!r} needs the dense encoder; this retriever was opened in "
                "bm25 mode without one."
            )

    @property
    def max_query_chars(self) -> int:
        """Queries are cut to this many characters before encoding (the encoder truncates tokens anyway)."""
        from tandemrl.retrieval.encoders import CHARS_PER_TOKEN_BOUND

        return (self.encoder.max_seq_length if self.encoder else 512) * CHARS_PER_TOKEN_BOUND

    def search(self, queries: list[str], topks: list[int], mode: str | None = None) -> list[list[Hit]]:
        """`topks[i]` hits for `queries[i]`, best first; all queries go through one encoder call."""
        mode = mode or self.mode
        self._check_mode(mode)
        if len(queries) != len(topks):
            raise ValueError(f"{len(queries)} queries but {len(topks)} topk values.")
        if not queries:
            return []
        queries = [query[: self.max_query_chars] for query in queries]
        dense = self.encoder.encode_queries(queries) if mode != "bm25" else None
        sparse = (
            [bm25.query_vector(query, self.meta.bm25_tokenizer) for query in queries]
            if mode != "dense"
            else None
        )
        searcher = self.memory or self.store
        return searcher.search(mode, topks, dense=dense, sparse=sparse, fusion=self.fusion)

    def close(self) -> None:
        self.store.close()
