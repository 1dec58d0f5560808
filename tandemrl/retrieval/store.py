"""The Qdrant collection behind an index: local mode on disk (`QdrantClient(path=...)`) or a Qdrant
server (`QdrantClient(url=...)`) through the same calls.

Invariant: a passage's point id is a UUID derived from its passage id, so re-indexing the same corpus
finds the points already there and skips them. `search` uses Qdrant's batched query API, fast on a
Qdrant server (a hybrid query fetches both lists and fuses them here, see fusion.py); in local mode the
retriever searches a `MemoryIndex` instead (see memory.py), which scores identically. Qdrant local
mode lets one process open a path; the retrieval server owns its index while it runs, everyone else
goes through HTTP.
"""

from __future__ import annotations

import sqlite3
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandemrl.retrieval.bm25 import SparseVector
from tandemrl.retrieval.fusion import FusionParams, fuse

COLLECTION = "passages"
DENSE = "dense"
SPARSE = "bm25"
MODES = ("dense", "bm25", "hybrid")
# The namespace is fixed forever: changing it would orphan every point of every existing index.
POINT_NAMESPACE = uuid.UUID("6f1c2a4e-7d3b-4e59-9a51-3c2b8d0e1f47")


def server_errors() -> tuple[type[Exception], ...]:
    """What the Qdrant client raises when a server cannot be reached or refuses a call."""
    from qdrant_client.http.exceptions import ApiException

    return (ApiException,)


def point_id(passage_id: str) -> str:
    return str(uuid.uuid5(POINT_NAMESPACE, passage_id))


@dataclass(frozen=True)
class Hit:
    document: dict  # the corpus record as indexed, e.g. {"id": ..., "contents": "\"Title\"\ntext"}
    score: float


LOCAL_DIR = "qdrant"  # the local-mode collection inside an index directory (Qdrant locks its `.lock`)


class QdrantStore:
    def __init__(
        self, index_dir: Path | None = None, qdrant_url: str | None = None, collection: str = COLLECTION
    ):
        from qdrant_client import QdrantClient

        if qdrant_url is None and index_dir is None:
            raise ValueError("QdrantStore needs an index directory (local mode) or a Qdrant server URL.")
        self.collection = collection
        self.is_local = qdrant_url is None
        self.location = qdrant_url or str(Path(index_dir) / LOCAL_DIR)
        try:
            self.client = QdrantClient(url=qdrant_url) if qdrant_url else QdrantClient(path=self.location)
        except RuntimeError as error:
            if "already accessed" in str(error):
                raise RuntimeError(
                    f"the index at {self.location} is open in another process (a running retrieval server?). "
                    "Qdrant local mode allows one process per path: stop that process, or query it over HTTP."
                ) from error
            raise
        self._relax_local_fsync()

    def _relax_local_fsync(self) -> None:
        """Qdrant local mode commits every point in its own sqlite transaction, and the default rollback
        journal fsyncs each commit (~16 ms here), capping indexing at ~60 passages/s. WAL with
        synchronous=NORMAL keeps the file consistent after a crash (a resumed build re-adds anything lost)
        without an fsync per commit. No-op against a Qdrant server or if the client's internals differ."""
        collections = getattr(getattr(self.client, "_client", None), "collections", None)
        collection = collections.get(self.collection) if isinstance(collections, dict) else None
        connection = getattr(getattr(collection, "storage", None), "storage", None)
        if isinstance(connection, sqlite3.Connection):
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        self.client.close()

    def exists(self) -> bool:
        return self.client.collection_exists(self.collection)

    def create(self, dim: int, has_sparse: bool) -> None:
        from qdrant_client import models

        sparse = {SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)} if has_sparse else None
        self.client.create_collection(
            self.collection,
            vectors_config={DENSE: models.VectorParams(size=dim, distance=models.Distance.COSINE)},
            sparse_vectors_config=sparse,
        )
        self._relax_local_fsync()

    def count(self) -> int:
        return self.client.count(self.collection, exact=True).count

    def existing(self, point_ids: list[str]) -> set[str]:
        records = self.client.retrieve(self.collection, ids=point_ids, with_payload=False, with_vectors=False)
        return {str(record.id) for record in records}

    def upsert(
        self,
        point_ids: list[str],
        documents: list[dict],
        dense: np.ndarray,
        sparse: list[SparseVector] | None,
    ) -> None:
        from qdrant_client import models

        points = []
        for i, (pid, document) in enumerate(zip(point_ids, documents, strict=True)):
            vector: dict = {DENSE: dense[i].tolist()}
            if sparse is not None:
                vector[SPARSE] = models.SparseVector(indices=sparse[i].indices, values=sparse[i].values)
            points.append(models.PointStruct(id=pid, vector=vector, payload={"document": document}))
        self.client.upsert(self.collection, points=points, wait=True)

    def search(
        self,
        mode: str,
        topks: list[int],
        dense: np.ndarray | None = None,
        sparse: list[SparseVector] | None = None,
        fusion: FusionParams = FusionParams(),
    ) -> list[list[Hit]]:
        """One batched Qdrant call for all queries; `topks[i]` hits for query i, best first. A hybrid query
        asks for its dense and its BM25 list and merges them with `fusion.fuse`, as `MemoryIndex` does."""
        assert mode in MODES, mode
        per_query = [self._requests(mode, i, topk, dense, sparse, fusion) for i, topk in enumerate(topks)]
        asked = [request for requests in per_query for request in requests]
        responses = iter(self.client.query_batch_points(self.collection, requests=asked) if asked else [])
        results: list[list[Hit]] = []
        for topk, requests in zip(topks, per_query, strict=True):
            lists = [next(responses).points for _ in requests]
            if len(lists) == 2:
                payloads = {point.id: point.payload["document"] for points in lists for point in points}
                ranked = fuse(*([(p.id, p.score) for p in points] for points in lists), topk, fusion)
                results.append([Hit(document=payloads[pid], score=score) for pid, score in ranked])
            else:
                points = lists[0] if lists else []
                results.append([Hit(document=p.payload["document"], score=float(p.score)) for p in points])
        return results

    def _requests(
        self,
        mode: str,
        i: int,
        topk: int,
        dense: np.ndarray | None,
        sparse: list[SparseVector] | None,
        fusion: FusionParams,
    ) -> list:
        """The Qdrant requests for query i: none, one (dense or BM25), or two (hybrid: dense, then BM25)."""
        from qdrant_client import models

        dense_query = dense[i].tolist() if dense is not None else None
        sparse_query = None
        if sparse is not None and sparse[i].indices:  # a query of punctuation only has no terms
            sparse_query = models.SparseVector(indices=sparse[i].indices, values=sparse[i].values)
        if mode == "dense" or (mode == "hybrid" and sparse_query is None):
            return [models.QueryRequest(query=dense_query, using=DENSE, limit=topk, with_payload=True)]
        if mode == "bm25":
            if sparse_query is None:  # nothing to match: an empty result rather than an arbitrary one
                return []
            return [models.QueryRequest(query=sparse_query, using=SPARSE, limit=topk, with_payload=True)]
        depth = max(fusion.prefetch, topk)
        # payloads for the whole depth keep it to one round trip; Qdrant's own RRF query cannot do z-scores
        return [
            models.QueryRequest(query=dense_query, using=DENSE, limit=depth, with_payload=True),
            models.QueryRequest(query=sparse_query, using=SPARSE, limit=depth, with_payload=True),
        ]
