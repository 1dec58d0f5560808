"""`tandem index build` refuses, in one line and before the encoder loads, an `--index` it could not replace
without losing something (tandemrl/retrieval/index_place.py) and corpus JSON that Python's `json` would let
through (duplicate keys, NaN; tandemrl/retrieval/corpus.py); a build that fails leaves no staging folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.cli import main
from tandemrl.retrieval import build
from tandemrl.retrieval.encoders import Encoder
from tests.unit.test_retrieval_index import PASSAGES, write_corpus

pytestmark = pytest.mark.usefixtures("prepared_home")


@pytest.fixture
def no_encoder(monkeypatch):
    """Every refusal here comes before the encoder loads: loading it fails the test."""

    def refuse(*_, **__):
        raise AssertionError("the encoder was loaded before the input was refused")

    monkeypatch.setattr(Encoder, "from_name", refuse)


def _tandem_build(capsys, corpus: Path | str, index: Path | str, *flags: str) -> tuple[int, str]:
    code = main(["index", "build", "--corpus", str(corpus), "--index", str(index), *flags])
    err = capsys.readouterr().err
    if code != 0:
        said = [line for line in err.splitlines() if line.startswith("tandem")]  # not the progress bars
        assert "Traceback" not in err and len(said) == 1, err
    return code, err


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_index_that_also_holds_the_corpus_and_a_readme_is_never_replaced(tmp_path, capsys):
    index = tmp_path / "idx"
    assert _tandem_build(capsys, write_corpus(tmp_path / "c.jsonl", PASSAGES[:2]), index)[0] == 0
    write_corpus(index / "my_corpus.jsonl", PASSAGES[2:4])
    (index / "README.txt").write_text("about this index")
    before = _tree(index)
    code, err = _tandem_build(capsys, index / "my_corpus.jsonl", index)
    assert code == 2 and "is inside" in err and "my_corpus.jsonl" in err, err
    write_corpus(tmp_path / "outside.jsonl", PASSAGES[2:4])
    code, err = _tandem_build(capsys, tmp_path / "outside.jsonl", index)
    assert code == 2 and f"--index {index}" in err and "('README.txt', 'my_corpus.jsonl')" in err, err
    assert "empty or new folder" in err
    assert _tree(index) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "idx", "outside.jsonl"]


@pytest.mark.parametrize("where", ["qdrant/mine/c.jsonl", "index.json"])
def test_a_corpus_inside_the_index_under_a_name_the_build_writes_is_kept(tmp_path, capsys, where):
    index = tmp_path / "idx"
    corpus = index / where
    corpus.parent.mkdir(parents=True)
    write_corpus(corpus, PASSAGES[:2])
    before = corpus.read_bytes()
    code, err = _tandem_build(capsys, corpus, index)
    assert code == 2 and "is inside" in err and "would be lost" in err, err
    assert corpus.read_bytes() == before


def test_a_corpus_inside_the_staging_folder_is_kept(tmp_path, capsys, no_encoder):
    corpus = write_corpus((tmp_path / ".idx.building").mkdir() or tmp_path / ".idx.building" / "c.jsonl")
    code, err = _tandem_build(capsys, corpus, tmp_path / "idx")
    assert code == 2 and "is inside" in err and corpus.is_file(), err


NON_FINITE = {
    "NaN": ('{"id": "a", "contents": "hello world", "score": NaN}', "field 'score' is NaN"),
    "Infinity": ('{"id": "a", "contents": "hello", "score": -Infinity}', "field 'score' is -Infinity"),
    "beyond float range": ('{"id": "a", "contents": "hello", "score": 1e999}', "field 'score' is 1e999"),
    "nested": ('{"id": "a", "contents": "x", "m": {"s": [1, 2, NaN]}}', "field 'm'['s'][2] is NaN"),
    "as the id": ('{"id": NaN, "contents": "x"}', "field 'id' is NaN"),
    "a duplicate key": ('{"id": "a", "contents": "x", "contents": "y"}', "key 'contents' appears twice"),
    "a nested duplicate key": (
        '{"id": "a", "contents": "x", "m": {"k": 1, "k": 2}}',
        "key 'k' appears twice",
    ),
    "a byte-order mark": ("\ufeff" + '{"id": "a", "contents": "x"}', "byte-order mark"),
}


@pytest.mark.parametrize("case", NON_FINITE)
def test_json_the_server_could_not_send_back_or_that_loses_a_value_is_refused(
    case, tmp_path, capsys, no_encoder
):
    line, expected = NON_FINITE[case]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "z", "contents": "fine"}\n' + line + "\n", encoding="utf-8")
    code, err = _tandem_build(capsys, corpus, tmp_path / "index")
    assert code == 2 and "c.jsonl:2:" in err and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_a_corpus_without_a_word_for_bm25_is_named_before_encoding(tmp_path, capsys, no_encoder):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": t}) + "\n" for i, t in enumerate("!?.")))
    code, err = _tandem_build(capsys, corpus, tmp_path / "index", "--sparse", "bm25")
    assert code == 2 and f"corpus {corpus}" in err and "no record has a word BM25 can index" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # no .index.building


def test_a_build_that_fails_while_encoding_leaves_no_staging_folder(tmp_path, capsys, monkeypatch):
    index = tmp_path / "idx"
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:2])
    assert _tandem_build(capsys, corpus, index)[0] == 0
    before = _tree(index)

    def broken(*_):
        raise ValueError("BM25 parameters are wrong")

    monkeypatch.setattr(build.bm25, "passage_vector", broken)
    code, err = _tandem_build(
        capsys, write_corpus(tmp_path / "d.jsonl", PASSAGES[2:5]), index, "--sparse", "bm25"
    )
    assert code == 2 and "BM25 parameters are wrong" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "d.jsonl", "idx"]
    assert _tree(index) == before


@pytest.mark.parametrize(
    ("place", "expected"),
    [
        ("", "--index is empty"),
        (".", "names no folder of its own"),
        ("..", "names no folder of its own"),
        ("/", "names no folder of its own"),
        ("{cwd}", "is the current directory or holds it"),
        ("a_file/sub", "--index a_file/sub: 'a_file' is a file, not a directory"),
        ("a_file/sub/deeper", "--index a_file/sub/deeper: 'a_file' is a file, not a directory"),
        ("x" * 300 + "/sub", "cannot be used (File name too long)"),
    ],
)
def test_an_index_that_cannot_be_placed_is_refused_before_encoding(
    place, expected, tmp_path, capsys, monkeypatch, no_encoder
):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a_file").write_text("mine")
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:2])
    monkeypatch.chdir(work)
    code, err = _tandem_build(capsys, corpus, place.format(cwd=work))
    assert code == 2 and expected in err, err
    assert sorted(p.name for p in work.iterdir()) == ["a_file"] and (work / "a_file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "work"]
