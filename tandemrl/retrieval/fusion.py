"""Hybrid fusion: merge the dense and the BM25 ranked lists of one query into one ranking.

Pure functions over ranked lists `[(key, score), ...]` (best first, as each retriever returned them), used
by both search paths (`MemoryIndex` in local mode, `QdrantStore` against a Qdrant server), so a hybrid
search ranks the same way wherever the vectors live.

Invariant: the fused list holds each key at most once, at most `limit` of them, best first, and ties on the
fused score keep first-seen order (dense list first, then BM25), so a fusion is deterministic.

Methods:
- `rrf`: reciprocal-rank fusion, Σ wᵢ / (k + rankᵢ) over the lists that hold the key (ranks 0-based,
  as Qdrant). Blind to scores: a retriever that is lost on a query pulls as hard as one that is sure.
- `zscore` (the default): each list's scores are standardised against that list's own candidates,
  zᵢ = (sᵢ − mean) / std, and the fused score is Σ wᵢ·zᵢ; a key missing from a list gets that list's
  lowest z. A retriever whose best hit stands far above its other candidates (it is confident) contributes
  a large z, one whose candidates all score alike contributes little, so the weaker retriever stops
  dragging the stronger one down on a query it cannot answer, and still helps where it is sure. BM25's
  weight is below dense's because on real text BM25 is the one that is confidently wrong more often.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

Ranked = Sequence[tuple[Hashable, float]]
METHODS = ("zscore", "rrf")


@dataclass(frozen=True)
class FusionParams:
    """How `hybrid` merges its two lists; each list is fetched `prefetch` deep (at least topk).

    The default (z-score, BM25 weighted 0.2 against dense 1.0) was chosen by benchmarks/retrieval/retrieval_fusion.py
    on the dev splits of the generated KB and of a real-text set (FanOutQA questions over Wikipedia
    summaries), and is reported on their test splits: see docs/RETRIEVAL.md.
    """

    method: str = "zscore"
    dense_weight: float = 1.0
    sparse_weight: float = 0.2
    rrf_k: int = 60  # for method "rrf": the usual choice (Cormack et al.); Qdrant's default is 2
    prefetch: int = 50

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"fusion method {self.method!r} is not one of {', '.join(METHODS)}.")
        if self.dense_weight < 0 or self.sparse_weight < 0 or self.dense_weight + self.sparse_weight == 0:
            raise ValueError(
                f"fusion weights dense={self.dense_weight}, sparse={self.sparse_weight}: need both >= 0 and "
                "at least one > 0."
            )
        if self.rrf_k < 0 or self.prefetch < 1:
            raise ValueError(f"rrf_k={self.rrf_k}, prefetch={self.prefetch}: need rrf_k >= 0, prefetch >= 1.")

    @property
    def weights(self) -> tuple[float, float]:
        return (self.dense_weight, self.sparse_weight)


def default_fusion(method: str = "zscore") -> FusionParams:
    """Each method at its default: z-score with BM25 weighted 0.2; RRF unweighted with k=60, the hybrid
    of earlier versions (`tandem serve-retrieval --fusion rrf` brings it back)."""
    if method == "rrf":
        return FusionParams(method="rrf", sparse_weight=1.0)
    return FusionParams(method=method)


def fuse(dense: Ranked, sparse: Ranked, limit: int, params: FusionParams) -> list[tuple[Hashable, float]]:
    """The hybrid ranking of one query from its dense and BM25 lists."""
    if params.method == "rrf":
        return rrf([dense, sparse], limit, params.rrf_k, params.weights)
    return zscore([dense, sparse], limit, params.weights)


def _best_first(scores: dict[Hashable, float], limit: int) -> list[tuple[Hashable, float]]:
    # sorted() is stable: among equal fused scores the first-seen key stays first
    return sorted(scores.items(), key=lambda item: -item[1])[: max(limit, 0)]


def rrf(
    ranked_lists: Sequence[Ranked], limit: int, k: int = 60, weights: Sequence[float] | None = None
) -> list[tuple[Hashable, float]]:
    weights = [1.0] * len(ranked_lists) if weights is None else weights
    if len(weights) != len(ranked_lists):
        raise ValueError(f"{len(weights)} weights for {len(ranked_lists)} ranked lists.")
    scores: dict[Hashable, float] = {}
    for ranked, weight in zip(ranked_lists, weights, strict=True):
        for rank, (key, _) in enumerate(ranked):
            scores[key] = scores.get(key, 0.0) + weight / (k + rank)
    return _best_first(scores, limit)


def standardise(scores: Sequence[float]) -> np.ndarray:
    """(s − mean) / std over one list; a list of equal scores (or a single hit) carries no preference: 0."""
    values = np.asarray(scores, dtype=np.float64)
    if len(values) == 0:
        return values
    std = values.std()
    if not np.isfinite(std) or std <= 1e-12 * max(1.0, float(np.abs(values).max())):
        return np.zeros_like(values)
    return (values - values.mean()) / std


def zscore(
    ranked_lists: Sequence[Ranked], limit: int, weights: Sequence[float] | None = None
) -> list[tuple[Hashable, float]]:
    weights = [1.0] * len(ranked_lists) if weights is None else weights
    if len(weights) != len(ranked_lists):
        raise ValueError(f"{len(weights)} weights for {len(ranked_lists)} ranked lists.")
    per_list: list[tuple[dict[Hashable, float], float, float]] = []
    order: dict[Hashable, None] = {}  # first-seen order across the lists
    for ranked, weight in zip(ranked_lists, weights, strict=True):
        z = standardise([score for _, score in ranked])
        by_key: dict[Hashable, float] = {}
        for (key, _), value in zip(ranked, z, strict=True):
            by_key.setdefault(key, float(value))  # a key listed twice keeps its better (first) rank
            order.setdefault(key, None)
        per_list.append((by_key, float(z.min()) if len(z) else 0.0, weight))
    fused = {key: sum(weight * by_key.get(key, floor) for by_key, floor, weight in per_list) for key in order}
    return _best_first(fused, limit)
