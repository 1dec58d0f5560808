"""Index building and searching on a tiny corpus with the real MiniLM encoder and Qdrant local mode."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tandemrl.retrieval import bm25
from tandemrl.retrieval.build import build_index, read_corpus
from tandemrl.retrieval.encoders import Encoder, EncoderSpec, resolve_encoder
from tandemrl.retrieval.fusion import FusionParams, default_fusion, zscore
from tandemrl.retrieval.retriever import IndexMeta, Retriever
from tandemrl.retrieval.store import QdrantStore

PASSAGES = [
    ("p0", "Alaric Venn", "Alaric Venn was born in Marrowdale in 1903. He worked as a cartographer."),
    ("p1", "Brisa Tallow", "Brisa Tallow is a violinist who plays with the Sablecrest orchestra."),
    ("p2", "Marrowdale", "Marrowdale is a river town founded in 1712 by salt traders."),
    ("p3", "Quenton Falls", "Quenton Falls lies in the Kingdom of Veltaria, north of the lakes."),
    ("p4", "The Iron Meadow", "The Iron Meadow is a novel written by Corin Maddox, published in 1987."),
    ("p5", "Northwind Guild", "Northwind Guild is a brewing company headquartered in Oskarport."),
    ("p6", "Delphine Oaks", "Delphine Oaks founded the Northwind Guild after leaving the navy."),
    ("p7", "Thistlemere", "Thistlemere is the capital city of Veltaria and its largest port."),
]


def write_corpus(path: Path, passages=PASSAGES) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for pid, title, text in passages:
            handle.write(json.dumps({"id": pid, "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory, minilm_dir) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("retrieval_index")
    corpus = write_corpus(root / "corpus.jsonl")
    stats = build_index(
        corpus, root / "index", encoder=str(minilm_dir), sparse="bm25", batch_size=3, show_progress=False
    )
    return corpus, root / "index", stats


@pytest.fixture(scope="module")
def retriever(index):
    retriever = Retriever(index[1], mode="hybrid")
    yield retriever
    retriever.close()


def test_build_indexes_every_passage_and_writes_meta(index, minilm_dir):
    _, index_dir, stats = index
    assert stats["num_indexed"] == len(PASSAGES) and stats["num_skipped"] == 0
    assert stats["num_in_index"] == len(PASSAGES) and stats["passages_per_s"] > 0
    meta = IndexMeta.load(index_dir)
    assert (meta.encoder, meta.dim, meta.sparse, meta.num_passages) == (
        str(minilm_dir),
        384,
        "bm25",
        len(PASSAGES),
    )
    lengths = [len(bm25.tokenize(f'"{title}"\n{text}')) for _, title, text in PASSAGES]
    assert meta.bm25["avgdl"] == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_each_mode_finds_the_passage_first(retriever, mode):
    queries = ["Where was Alaric Venn born?", "Who wrote The Iron Meadow?", "capital city of Veltaria"]
    results = retriever.search(queries, [3, 3, 2], mode=mode)
    assert [hits[0].document["id"] for hits in results] == ["p0", "p4", "p7"]
    lengths = [len(hits) for hits in results]
    if mode == "bm25":  # only passages sharing a term with the query match
        assert 1 <= lengths[0] <= 3 and lengths[1:] == [3, 2]
    else:
        assert lengths == [3, 3, 2]
    for hits in results:
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:], strict=False))
    assert results[0][0].document == {"id": "p0", "contents": f'"Alaric Venn"\n{PASSAGES[0][2]}'}


def test_dense_scores_are_cosines(retriever):
    text = f'"Marrowdale"\n{PASSAGES[2][2]}'
    hits = retriever.search([text], [2], mode="dense")[0]
    assert hits[0].document["id"] == "p2" and hits[0].score == pytest.approx(1.0, abs=1e-4)
    assert -1.0 <= hits[1].score < hits[0].score


def test_bm25_scores_match_a_reference_bm25(retriever, index):
    """Qdrant's IDF modifier x our TF weights must equal textbook BM25 (k1=1.2, b=0.75)."""
    records = list(read_corpus(index[0]))
    docs = [Counter(bm25.tokenize(record["contents"])) for record in records]
    avgdl = sum(sum(doc.values()) for doc in docs) / len(docs)
    query = "river town founded by salt traders"

    def reference(doc: Counter) -> float:
        score = 0.0
        for term in set(bm25.tokenize(query)):
            n = sum(term in other for other in docs)
            idf = math.log((len(docs) - n + 0.5) / (n + 0.5) + 1)
            tf, length = doc[term], sum(doc.values())
            score += idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * length / avgdl))
        return score

    expected = sorted(
        ((reference(doc), record["id"]) for doc, record in zip(docs, records, strict=True)), reverse=True
    )[:3]
    hits = retriever.search([query], [3], mode="bm25")[0]
    assert [hit.document["id"] for hit in hits] == [pid for _, pid in expected]
    assert [hit.score for hit in hits] == pytest.approx([score for score, _ in expected], rel=1e-4)


def test_hybrid_scores_are_the_default_fusion_of_both_lists(retriever):
    query = ["Northwind Guild brewing company"]
    depth = len(PASSAGES)
    dense, sparse = (retriever.search(query, [depth], mode=mode)[0] for mode in ("dense", "bm25"))
    lists = [[(hit.document["id"], hit.score) for hit in hits] for hits in (dense, sparse)]
    expected = zscore(lists, limit=2, weights=FusionParams().weights)
    hits = retriever.search(query, [2], mode="hybrid")[0]
    assert [(hit.document["id"], hit.score) for hit in hits] == [
        (pid, pytest.approx(score)) for pid, score in expected
    ]
    assert hits[0].document["id"] == "p5"


def test_hybrid_rrf_scores_are_reciprocal_rank_fusion(retriever):
    retriever.fusion = default_fusion("rrf")
    try:
        hits = retriever.search(["Northwind Guild brewing company"], [2], mode="hybrid")[0]
    finally:
        retriever.fusion = FusionParams()
    assert hits[0].document["id"] == "p5"
    assert hits[0].score == pytest.approx(2 / 60)  # first in both lists: 1/(k + 0-based rank), k=60


@pytest.mark.parametrize(
    ("mode", "method"), [("dense", "zscore"), ("bm25", "zscore"), ("hybrid", "zscore"), ("hybrid", "rrf")]
)
def test_in_memory_search_matches_qdrant_query_api(retriever, mode, method):
    """The local-mode fast path must rank and score exactly like Qdrant's own query API."""
    queries = [
        "Where was Alaric Venn born?",
        "Northwind Guild founder",
        "Veltaria",
        "novel published 1987",
        "river town salt traders",
        "zzz unknown words",
    ]
    dense = retriever.encoder.encode_queries(queries)
    sparse = [bm25.query_vector(query) for query in queries]
    topks = [3, 8, 2, 5, 1, 4]
    fusion = FusionParams(method=method, rrf_k=60, prefetch=8)
    ours = retriever.memory.search(mode, topks, dense=dense, sparse=sparse, fusion=fusion)
    qdrant = retriever.store.search(mode, topks, dense=dense, sparse=sparse, fusion=fusion)
    for mine, theirs in zip(ours, qdrant, strict=True):
        assert [hit.document["id"] for hit in mine] == [hit.document["id"] for hit in theirs]
        assert [hit.score for hit in mine] == pytest.approx([hit.score for hit in theirs], rel=1e-4, abs=1e-6)
    assert retriever.memory is not None and retriever.store.is_local


def test_queries_without_terms_and_overlong_queries(retriever):
    assert retriever.search(["?!"], [3], mode="bm25") == [[]]
    assert len(retriever.search(["?!"], [3], mode="hybrid")[0]) == 3  # falls back to dense
    overlong = "Where was Alaric Venn born? " * 20000
    hits = retriever.search([overlong], [1], mode="hybrid")[0]
    assert hits[0].document["id"] == "p0"
    assert retriever.search([], []) == []


def test_rebuild_of_the_same_corpus_is_a_no_op_and_a_grown_corpus_is_indexed_whole(prepared_home, tmp_path):
    small = write_corpus(tmp_path / "small.jsonl", PASSAGES[:5])
    grown = write_corpus(
        tmp_path / "grown.jsonl", PASSAGES + [("p8", "Oskarport", "Oskarport is a harbour city.")]
    )
    first = build_index(small, tmp_path / "index", sparse="bm25", show_progress=False)
    again = build_index(small, tmp_path / "index", sparse="bm25", show_progress=False)
    rebuilt = build_index(grown, tmp_path / "index", sparse="bm25", show_progress=False)
    assert (first["num_indexed"], again["num_indexed"], again["num_skipped"]) == (5, 0, 5)
    assert (rebuilt["num_indexed"], rebuilt["num_skipped"], rebuilt["num_in_index"]) == (9, 0, 9)
    retriever = Retriever(tmp_path / "index", mode="bm25")
    try:
        assert retriever.search(["harbour city"], [1])[0][0].document["id"] == "p8"
    finally:
        retriever.close()


def test_an_open_index_cannot_be_opened_twice(retriever, index):
    """Qdrant local mode: one client per path; the error says what to do instead."""
    with pytest.raises(RuntimeError, match="open in another process.*query it over HTTP"):
        QdrantStore(index[1])


def test_rebuild_with_other_settings_replaces_the_index(prepared_home, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:3])
    build_index(corpus, tmp_path / "i", sparse="bm25", show_progress=False)
    stats = build_index(corpus, tmp_path / "i", sparse=None, show_progress=False)
    assert stats["num_indexed"] == 3 and IndexMeta.load(tmp_path / "i").sparse is None


def test_dense_only_index_refuses_bm25_modes(prepared_home, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:2])
    build_index(corpus, tmp_path / "dense", show_progress=False)
    with pytest.raises(ValueError, match="needs BM25 vectors"):
        Retriever(tmp_path / "dense", mode="hybrid")
    retriever = Retriever(tmp_path / "dense")
    try:
        assert retriever.mode == "dense"
        assert retriever.search(["violinist"], [1])[0][0].document["id"] == "p1"
    finally:
        retriever.close()


CJK_PASSAGES = [
    ("j0", "東京都庁", "東京都庁の所在地は新宿区西新宿である。"),
    ("j1", "大阪城", "大阪城は大阪市中央区にある城である。"),
    ("k0", "서울", "서울특별시는 대한민국의 수도이다."),
]


def test_an_index_of_the_older_bm25_tokenizer_serves_as_built_then_a_build_upgrades_it(
    prepared_home, tmp_path, monkeypatch
):
    """An index.json without `bm25_tokenizer` was written by version 1, whose terms were whole CJK runs: it
    still serves, its queries tokenized as its passages were (an identical run matches, a partial one does
    not, as before); a build of the same corpus replaces it, and then a Chinese or Japanese query finds its
    passage by shared characters. A version this code does not know is refused, naming the rebuild."""
    corpus, index = write_corpus(tmp_path / "c.jsonl", CJK_PASSAGES), tmp_path / "index"
    with monkeypatch.context() as patch:  # the passages as version 1 tokenized them
        old = bm25.tokenize
        patch.setattr(bm25, "tokenize", lambda text, version=1: old(text, 1))
        build_index(corpus, index, sparse="bm25", show_progress=False)
    meta = json.loads((index / "index.json").read_text())
    assert meta.pop("bm25_tokenizer") == bm25.TOKENIZER_VERSION == 2
    (index / "index.json").write_text(json.dumps(meta))
    assert IndexMeta.load(index).bm25_tokenizer == 1
    queries = ["東京都庁の所在地は新宿区西新宿である", "東京の都庁はどこ", "서울특별시는"]
    retriever = Retriever(index, mode="bm25")
    try:
        found = retriever.search(queries, [1, 1, 1])
        assert [[hit.document["id"] for hit in hits] for hits in found] == [["j0"], [], ["k0"]]
    finally:
        retriever.close()
    stats = build_index(corpus, index, sparse="bm25", show_progress=False)
    assert stats["num_indexed"] == 3 and IndexMeta.load(index).bm25_tokenizer == 2
    retriever = Retriever(index, mode="bm25")
    try:
        found = retriever.search([*queries[1:], "大阪城"], [1, 1, 1])
        assert [hits[0].document["id"] for hits in found] == ["j0", "k0", "j1"]
        assert retriever.search(["특별시"], [1]) == [[]]  # Hangul words stay whole: no term in common
    finally:
        retriever.close()
    meta = json.loads((index / "index.json").read_text())
    (index / "index.json").write_text(json.dumps({**meta, "bm25_tokenizer": 99}))
    with pytest.raises(
        ValueError,
        match=rf"index at {re.escape(str(index))} were made by tokenizer version 99, .*Rebuild it with `tandem",
    ):
        Retriever(index)  # hybrid, the default of a BM25 index
    Retriever(index, mode="dense").close()  # dense search reads no BM25 vector


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "i", show_progress=False)
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "contents": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(read_corpus(tmp_path / "bad.jsonl"))
    (tmp_path / "tt.jsonl").write_text('{"title": "T", "text": "body"}\n')
    assert list(read_corpus(tmp_path / "tt.jsonl")) == [
        {"title": "T", "text": "body", "contents": '"T"\nbody', "id": "0"}
    ]
    with pytest.raises(FileNotFoundError, match="is not a built index"):
        Retriever(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="e5"):
        resolve_encoder(f"e5:{tmp_path / 'no-e5'}")
    with pytest.raises(FileNotFoundError, match="sentence-transformers directory"):
        resolve_encoder(str(tmp_path / "no-model"))
    with pytest.raises(ValueError, match="QdrantStore needs"):
        QdrantStore()


def test_e5_spec_prefixes_queries_and_passages(prepared_home, minilm_dir):
    """e5 weights are not shipped: MiniLM stands in to check the prefixing through `e5:DIR`."""
    minilm = resolve_encoder("minilm")
    assert minilm.path == minilm_dir  # "minilm" is the prepared home's copy
    spec = resolve_encoder(f"e5:{minilm.path}")
    assert (spec.query_prefix, spec.passage_prefix, spec.path) == ("query: ", "passage: ", minilm.path)
    e5, plain = Encoder(spec, device="cpu"), Encoder(EncoderSpec("plain", minilm.path), device="cpu")
    text = "Marrowdale river town"
    np.testing.assert_allclose(e5.encode_queries([text]), plain.encode_queries(["query: " + text]), atol=1e-5)
    np.testing.assert_allclose(
        e5.encode_passages([text]), plain.encode_passages(["passage: " + text]), atol=1e-5
    )
    assert not np.allclose(e5.encode_queries([text]), plain.encode_queries([text]), atol=1e-3)
    vectors = e5.encode_passages([text, "another"])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert e5.encode_queries([]).shape == (0, 384)


def test_cli_build_prints_stats_and_reports_bad_settings(prepared_home, tmp_path, capsys):
    from tandemrl.cli import build_parser
    from tandemrl.retrieval.build import run_build

    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:3])
    args = build_parser().parse_args(
        ["index", "build", "--corpus", str(corpus), "--index", str(tmp_path / "i")]
    )
    assert run_build(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_indexed"] == 3
    assert "3 passages in" in err and "as many as the corpus has (3)" in err
    args = build_parser().parse_args(
        ["index", "build", "--corpus", str(corpus), "--index", str(tmp_path / "i"), "--batch-size", "0"]
    )
    assert run_build(args) == 2
    assert "batch_size=0" in capsys.readouterr().err
