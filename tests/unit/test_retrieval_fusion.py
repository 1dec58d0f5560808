"""Hybrid fusion (tandemrl/retrieval/fusion.py): pure functions, checked by hand-computed values and by
invariants over many random lists (unique keys, at most `limit`, best first, deterministic ties)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandemrl.retrieval.fusion import FusionParams, default_fusion, fuse, rrf, standardise, zscore


def keys(ranked):
    return [key for key, _ in ranked]


# --- RRF ----------------------------------------------------------------------------------------------


def test_rrf_sums_reciprocal_ranks():
    fused = rrf([[("a", 9.0), ("b", 5.0)], [("b", 3.0), ("c", 1.0)]], limit=10, k=60)
    assert fused == [("b", pytest.approx(1 / 61 + 1 / 60)), ("a", pytest.approx(1 / 60)), ("c", 1 / 61)]


def test_weighted_rrf_scales_each_list():
    fused = rrf([[("a", 1.0)], [("b", 1.0)]], limit=2, k=1, weights=[1.0, 0.5])
    assert fused == [("a", 1.0), ("b", 0.5)]


def test_rrf_ties_keep_first_seen_order():
    # a and b both at rank 0 of one list: equal score, dense (first list) wins the tie
    assert keys(rrf([[("a", 1.0)], [("b", 1.0)]], limit=2, k=60)) == ["a", "b"]
    assert keys(rrf([[("b", 1.0)], [("a", 1.0)]], limit=2, k=60)) == ["b", "a"]


@pytest.mark.parametrize("lists", [[[], []], [[]], []])
def test_rrf_of_nothing_is_empty(lists):
    assert rrf(lists, limit=3) == []


def test_rrf_weight_count_must_match():
    with pytest.raises(ValueError, match="2 weights for 1 ranked lists"):
        rrf([[("a", 1.0)]], limit=1, weights=[1.0, 1.0])


# --- z-score fusion -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "expected"),
    [([], []), ([3.0], [0.0]), ([2.0, 2.0, 2.0], [0.0, 0.0, 0.0]), ([3.0, 1.0], [1.0, -1.0])],
)
def test_standardise_edge_cases(scores, expected):
    assert standardise(scores).tolist() == pytest.approx(expected)


def test_standardise_is_shift_and_scale_free():
    scores = [0.9, 0.5, 0.4, 0.1]
    assert standardise(scores) == pytest.approx(standardise([10 * s + 7 for s in scores]))


def test_zscore_matches_hand_computation():
    dense = [("a", 0.9), ("b", 0.6), ("c", 0.3)]  # z = 1.2247, 0, -1.2247
    sparse = [("c", 12.0), ("d", 4.0)]  # z = 1, -1
    z = np.sqrt(1.5)
    fused = zscore([dense, sparse], limit=10, weights=[1.0, 0.5])
    expected = {"a": z + 0.5 * -1, "b": 0.0 + 0.5 * -1, "c": -z + 0.5 * 1, "d": -z + 0.5 * -1}
    assert keys(fused) == sorted(expected, key=lambda key: -expected[key])
    assert dict(fused) == pytest.approx(expected)


def test_zscore_one_side_empty_keeps_the_other_order():
    dense = [("a", 0.9), ("b", 0.7), ("c", 0.2)]
    assert keys(zscore([dense, []], limit=10)) == ["a", "b", "c"]
    assert keys(zscore([[], dense], limit=2)) == ["a", "b"]


def test_zscore_of_nothing_is_empty():
    assert zscore([[], []], limit=3) == []


def test_zscore_ties_keep_first_seen_order():
    # mirror-image lists: every key gets the same fused score, dense order wins
    fused = zscore([[("a", 2.0), ("b", 1.0)], [("b", 2.0), ("a", 1.0)]], limit=2)
    assert fused[0][1] == pytest.approx(fused[1][1]) and keys(fused) == ["a", "b"]


def test_zscore_limit_larger_than_hits_and_zero_limit():
    lists = [[("a", 1.0), ("b", 0.5)], [("c", 3.0)]]
    assert sorted(keys(zscore(lists, limit=50))) == ["a", "b", "c"]
    assert zscore(lists, limit=0) == []


def test_a_flat_list_does_not_override_a_confident_one():
    """The property the default rests on: BM25 candidates that all score alike (BM25 has no idea) must not
    push out the passage the dense retriever is sure of, which plain RRF does."""
    dense = [("gold", 0.80)] + [(f"d{i}", 0.40 - 0.001 * i) for i in range(20)]
    sparse = [(f"d{i}", 5.0 - 0.01 * i) for i in range(1, 20)] + [("x", 4.7)]
    assert keys(zscore([dense, sparse], limit=3))[0] == "gold"
    assert "gold" not in keys(rrf([dense, sparse], limit=3))


def test_a_confident_sparse_hit_still_lifts_a_dense_runner_up():
    dense = [("a", 0.62), ("gold", 0.61)] + [(f"d{i}", 0.55 - 0.001 * i) for i in range(20)]
    sparse = [("gold", 30.0)] + [(f"s{i}", 8.0 - 0.01 * i) for i in range(20)]
    assert keys(zscore([dense, sparse], limit=1)) == ["gold"]


# --- invariants over random lists -----------------------------------------------------------------------


def _random_list(rng: random.Random, pool: list[str]) -> list[tuple[str, float]]:
    chosen = rng.sample(pool, rng.randint(0, len(pool)))
    scores = sorted((rng.choice([rng.random(), 0.5]) for _ in chosen), reverse=True)  # some ties
    return list(zip(chosen, scores, strict=True))


@pytest.mark.parametrize("method", ["zscore", "rrf"])
def test_fusion_invariants_on_random_lists(method):
    rng = random.Random(0)
    pool = [f"p{i}" for i in range(12)]
    for _ in range(500):
        dense, sparse = _random_list(rng, pool), _random_list(rng, pool)
        limit = rng.randint(0, 15)
        params = FusionParams(method=method, sparse_weight=rng.choice([0.0, 0.3, 1.0, 2.0]))
        fused = fuse(dense, sparse, limit, params)
        union = set(keys(dense)) | set(keys(sparse))
        assert len(fused) == min(limit, len(union))
        assert len(set(keys(fused))) == len(fused) and set(keys(fused)) <= union
        assert all(a[1] >= b[1] for a, b in zip(fused, fused[1:], strict=False))
        assert fused == fuse(dense, sparse, limit, params)  # deterministic


def test_zero_sparse_weight_is_dense_order():
    rng = random.Random(1)
    pool = [f"p{i}" for i in range(10)]
    for _ in range(200):
        dense = [(key, float(10 - i)) for i, key in enumerate(rng.sample(pool, 6))]  # no ties
        sparse = _random_list(rng, pool)
        fused = fuse(dense, sparse, 6, FusionParams(sparse_weight=0.0))
        assert keys(fused) == keys(dense)


# --- parameters -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "max"}, "fusion method 'max' is not one of zscore, rrf"),
        ({"dense_weight": -1.0}, "need both >= 0"),
        ({"dense_weight": 0.0, "sparse_weight": 0.0}, "at least one > 0"),
        ({"rrf_k": -1}, "rrf_k=-1"),
        ({"prefetch": 0}, "prefetch=0"),
    ],
)
def test_bad_fusion_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusionParams(**kwargs)


def test_fuse_dispatches_on_method():
    dense, sparse = [("a", 0.9), ("b", 0.1)], [("b", 9.0), ("c", 1.0)]
    assert fuse(dense, sparse, 3, default_fusion("rrf")) == rrf([dense, sparse], 3, 60)
    assert fuse(dense, sparse, 3, FusionParams(sparse_weight=0.5)) == zscore([dense, sparse], 3, [1.0, 0.5])
    assert FusionParams().method == "zscore" and FusionParams().weights == (1.0, 0.2)
    assert default_fusion() == FusionParams() and default_fusion("rrf").weights == (1.0, 1.0)
