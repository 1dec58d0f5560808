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


def test_text_without_cjk_tokenizes_as_before():
    """Written out from the tokenizer before Han and kana became one term per character (TOKENIZER_VERSION
    1): English, Latin with accents and other scripts keep their terms, or old indexes would mislead."""
    assert bm25.tokenize("Founded in 1998, the publishers") == ["found", "in", "1998", "the", "publisher"]
    assert bm25.tokenize("Côte d'Ivoire's capital_city x2 is Yamoussoukro.") == [
        "côte",
        "d",
        "ivoire",
        "s",
        "capital_city",
        "x2",
        "is",
        "yamoussoukro",
    ]
    assert bm25.tokenize("naïve café 3.14 U.S.A. e-mail") == [
        "naïve",
        "café",
        "3",
        "14",
        "u",
        "s",
        "a",
        "e",
        "mail",
    ]
    assert bm25.tokenize("Москва — столица России") == ["москва", "столица", "россии"]


def test_han_hiragana_and_katakana_are_one_term_per_character():
    assert bm25.tokenize("東京都庁の所在地") == ["東", "京", "都", "庁", "の", "所", "在", "地"]
    assert bm25.tokenize("カタカナ・ひらがな") == [
        "カ",
        "タ",
        "カ",
        "ナ",
        "ひ",
        "ら",
        "が",
        "な",
    ]  # ・ is no word
    assert bm25.tokenize("Tokyo 東京 Tower") == ["tokyo", "東", "京", "tower"]
    # a Latin run beside CJK is its own term, still stemmed; a CJK character is never stemmed
    assert bm25.tokenize("2024年にTowers建設") == ["2024", "年", "に", "tower", "建", "設"]
    assert bm25.tokenize("𠮷野家 々") == ["𠮷", "野", "家", "々"]  # outside the BMP; the iteration mark
    assert bm25.tokenize("か\u3099") == ["が"]  # decomposed kana is composed first (NFC)


def test_hangul_words_stay_whole():
    """Korean separates words with spaces, so a Hangul run is a word, as before."""
    assert bm25.tokenize("서울특별시 종로구에") == ["서울특별시", "종로구에"]
    assert bm25.tokenize("韓國어") == ["韓", "國", "어"]  # Han beside Hangul is still one per character


def test_a_cjk_query_shares_terms_with_a_longer_run():
    """Before, "東京都庁の所在地" was one term: a query matched only that exact run."""
    params = bm25.BM25Params(avgdl=10.0)
    passage = set(bm25.passage_vector("東京都庁の所在地は新宿区", params).indices)
    query = set(bm25.query_vector("東京の都庁").indices)
    assert query <= passage and len(query) == 5  # 東 京 の 都 庁
    assert not query & set(bm25.passage_vector("大阪城は大阪市にある", params).indices)


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
