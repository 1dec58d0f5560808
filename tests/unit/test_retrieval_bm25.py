"""BM25 sparse vectors: tokenizer, stable term ids and the passage/query weights (pure Python)."""

from __future__ import annotations

import pytest

from tandemrl.retrieval import bm25


def test_tokenize_casefolds_and_stems():
    assert bm25.tokenize("The Founder FOUNDED it, founding Marlowes!") == [
        "the",
        "found",
        "found",
        "it",
        "found",
        "marlowe",
    ]
    # short words keep their suffix: "bus" or "red" are not stems of anything
    assert bm25.tokenize("bus red sing") == ["bus", "red", "sing"]
    assert bm25.tokenize("") == []
    assert bm25.tokenize("Zoë Ångström") == ["zoë", "ångström"]


def test_term_ids_are_stable_u32():
    assert bm25.term_id("harbour") == bm25.term_id("harbour")
    assert bm25.term_id("harbour") != bm25.term_id("harbor")
    ids = [bm25.term_id(f"term{i}") for i in range(1000)]
    assert all(0 <= i < 2**32 for i in ids)
    assert len(set(ids)) == 1000
    # pinned: an index built today must be searchable by tomorrow's server
    assert bm25.term_id("river") == int.from_bytes(
        __import__("hashlib").blake2b(b"river", digest_size=4).digest(), "little"
    )


def test_passage_vector_is_bm25_term_frequency():
    params = bm25.BM25Params(k1=1.2, b=0.75, avgdl=4.0)
    vector = bm25.passage_vector("river town river", params)  # 3 tokens, "river" twice
    weights = dict(zip(vector.indices, vector.values, strict=True))
    norm = 1.2 * (1 - 0.75 + 0.75 * 3 / 4.0)
    assert weights[bm25.term_id("river")] == pytest.approx(2 * 2.2 / (2 + norm))
    assert weights[bm25.term_id("town")] == pytest.approx(1 * 2.2 / (1 + norm))
    assert vector.indices == sorted(vector.indices)


def test_longer_passages_weigh_a_term_less():
    params = bm25.BM25Params(avgdl=5.0)
    short = bm25.passage_vector("river", params)
    long = bm25.passage_vector("river " + "word " * 20, params)
    rid = bm25.term_id("river")
    assert (
        dict(zip(short.indices, short.values, strict=True))[rid]
        > dict(zip(long.indices, long.values, strict=True))[rid]
    )


def test_query_vector_counts_each_term_once():
    vector = bm25.query_vector("river river town")
    assert sorted(vector.indices) == sorted({bm25.term_id("river"), bm25.term_id("town")})
    assert vector.values == [1.0, 1.0]
    assert bm25.query_vector("   ").indices == []


def test_mean_length_and_params_validation():
    assert bm25.mean_length(["a b", "c d e f"]) == 3.0
    assert bm25.mean_length([]) == 1.0
    with pytest.raises(ValueError, match="avgdl"):
        bm25.BM25Params(avgdl=0)
    with pytest.raises(ValueError, match="b=2"):
        bm25.BM25Params(b=2)
