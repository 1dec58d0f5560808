"""`tandem index build` is all or nothing (docs/RELIABILITY.md, index builds): every record checked
before anything is encoded, ids unique and present (or all absent: numbered by line), a rebuild that
replaces the old contents, a failed build that leaves what was there, and no empty index built or
served. Real MiniLM encoder and Qdrant local mode on a tiny corpus."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tandemrl.cli import main
from tandemrl.retrieval.build import build_index
from tandemrl.retrieval.retriever import IndexMeta
from tandemrl.retrieval.store import QdrantStore
from tests.unit.test_retrieval_index import PASSAGES, write_corpus

# every build encodes with the default MiniLM of the session's prepared home (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("prepared_home")


def _write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def _record(pid: str | None, contents: str) -> str:
    return json.dumps({"contents": contents} if pid is None else {"id": pid, "contents": contents})


def _tandem_build(capsys, corpus: Path, index: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["index", "build", "--corpus", str(corpus), "--index", str(index), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _ids_and_texts(index: Path) -> dict[str, str]:
    """Every stored passage (id -> contents), read from the Qdrant collection itself."""
    store = QdrantStore(index, None, IndexMeta.load(index).collection)
    try:
        points, _ = store.client.scroll(store.collection, limit=1000, with_payload=True)
        return {p.payload["document"]["id"]: p.payload["document"]["contents"] for p in points}
    finally:
        store.close()


def test_a_record_without_an_id_among_records_with_ids_is_refused(tmp_path, capsys):
    """The old rule gave it its line number as id, which here is another record's id."""
    corpus = _write_lines(
        tmp_path / "c.jsonl", [_record("1", "Alaric Venn, cartographer"), _record(None, "Brisa")]
    )
    code, _, err = _tandem_build(capsys, corpus, tmp_path / "index")
    assert code == 2 and "c.jsonl:2" in err and "has no 'id'" in err and "Traceback" not in err
    assert not (tmp_path / "index").exists()


def test_a_corpus_without_any_id_is_numbered_by_line(tmp_path, capsys):
    lines = [_record(None, "Alaric Venn, cartographer"), "", _record(None, "Brisa Tallow, violinist")]
    code, out, _ = _tandem_build(capsys, _write_lines(tmp_path / "c.jsonl", lines), tmp_path / "index")
    assert code == 0 and json.loads(out)["num_in_index"] == 2
    assert _ids_and_texts(tmp_path / "index") == {
        "0": "Alaric Venn, cartographer",
        "2": "Brisa Tallow, violinist",
    }


def test_a_duplicate_id_is_refused_naming_both_lines(tmp_path, capsys):
    lines = [_record("a", "first text"), _record("b", "other"), _record("a", "second text")]
    code, _, err = _tandem_build(capsys, _write_lines(tmp_path / "c.jsonl", lines), tmp_path / "index")
    assert code == 2 and "id 'a' appears on lines 1, 3" in err, err
    assert not (tmp_path / "index").exists()


def test_a_rebuild_with_changed_contents_replaces_the_old_text(tmp_path, capsys):
    index = tmp_path / "index"
    old = write_corpus(tmp_path / "old.jsonl", PASSAGES[:3])
    new = write_corpus(
        tmp_path / "new.jsonl", [(pid, title, text + " Revised.") for pid, title, text in PASSAGES[1:4]]
    )
    assert _tandem_build(capsys, old, index)[0] == 0
    code, out, err = _tandem_build(capsys, new, index)
    assert code == 0 and json.loads(out)["num_indexed"] == 3, err
    assert "3 passages in" in err and "as many as the corpus has (3)" in err
    stored = _ids_and_texts(index)
    assert sorted(stored) == ["p1", "p2", "p3"] and all(text.endswith("Revised.") for text in stored.values())
    assert not list(tmp_path.glob(".index.*"))  # no staging or previous directory left


def test_an_empty_corpus_is_refused_and_an_empty_index_is_not_served(tmp_path, capsys, monkeypatch):
    code, _, err = _tandem_build(capsys, _write_lines(tmp_path / "c.jsonl", ["", "  "]), tmp_path / "index")
    assert code == 2 and "holds no passages" in err and not (tmp_path / "index").exists()
    # an empty index, as an older build wrote it: the server refuses it with one line, no traceback
    from tandemrl.retrieval.server import run_serve

    empty = tmp_path / "empty"
    store = QdrantStore(empty)
    store.create(384, has_sparse=False)
    store.close()
    IndexMeta(encoder="minilm", dim=384).save(empty)
    monkeypatch.delenv("TANDEM_RETRIEVAL_API_KEY", raising=False)
    args = argparse.Namespace(
        index=str(empty), host="127.0.0.1", port=0, mode=None, qdrant_url=None, api_key=None
    )
    assert run_serve(args) == 2
    err = capsys.readouterr().err
    assert "holds 0 passages" in err and "empty" in err and "tandem index build" in err


BAD_RECORDS = {
    "contents a number": ('{"id": "x", "contents": 5}', "'contents' must be a string"),
    "contents a list": ('{"id": "x", "contents": ["a"]}', "'contents' must be a string"),
    "contents a lone surrogate": ('{"id": "x", "contents": "ok \\ud800"}', "'contents' is not valid Unicode"),
    "contents empty": ('{"id": "x", "contents": ""}', "'contents' is empty"),
    "contents blank": ('{"id": "x", "contents": "  \\n "}', "'contents' is empty"),
    "title a number": ('{"id": "x", "title": 3, "text": "t"}', "'title' must be a string"),
    "text null": ('{"id": "x", "title": "T", "text": null}', "'text' must be a string"),
    "no contents": ('{"id": "x", "body": "t"}', "needs 'contents'"),
    "id null": ('{"id": null, "contents": "t"}', "'id' must be a non-empty string or an integer"),
    "id true": ('{"id": true, "contents": "t"}', "'id' must be a non-empty string or an integer"),
    "id a float": ('{"id": 1.5, "contents": "t"}', "'id' must be a non-empty string or an integer"),
    "id a mapping": ('{"id": {"a": 1}, "contents": "t"}', "'id' must be a non-empty string or an integer"),
    "id empty": ('{"id": "", "contents": "t"}', "'id' must be a non-empty string or an integer"),
    "id a lone surrogate": ('{"id": "\\udfff", "contents": "t"}', "'id' is not valid Unicode"),
    "other field a lone surrogate": ('{"id": "x", "contents": "t", "url": "\\ud800"}', "'url'"),
    "a JSON array": ('["x", "t"]', "not a JSON list"),
    "a JSON number": ("7", "not a JSON int"),
    "not JSON": ("{oops", "not valid JSON"),
    "an integer of 5000 digits": ('{"id": ' + "9" * 5000 + ', "contents": "t"}', "not valid JSON"),
    "nested 100000 deep": (
        '{"id": "x", "contents": "t", "m": ' + "[" * 100000 + "]" * 100000 + "}",
        "nested",
    ),
    "not UTF-8": (b'{"id": "x", "contents": "caf\xe9"}', "not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_a_bad_record_is_refused_naming_its_line(case, tmp_path, capsys):
    line, expected = BAD_RECORDS[case]
    corpus = _write_lines(tmp_path / "c.jsonl", [_record("a", "fine"), line])
    code, _, err = _tandem_build(capsys, corpus, tmp_path / "index")
    assert code == 2 and "c.jsonl:2" in err and expected in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "index").exists()


def test_a_failed_build_leaves_what_was_there(tmp_path, capsys):
    bad_last = [
        _record("n1", "new passage one"),
        _record("n2", "new passage two"),
        '{"id": "n3", "contents": 3}',
    ]
    corpus = _write_lines(tmp_path / "bad.jsonl", bad_last)
    assert _tandem_build(capsys, corpus, tmp_path / "fresh")[0] == 2
    assert not (tmp_path / "fresh").exists()  # no index.json of a build that failed
    index = tmp_path / "index"
    assert _tandem_build(capsys, write_corpus(tmp_path / "old.jsonl", PASSAGES[:2]), index)[0] == 0
    assert _tandem_build(capsys, corpus, index)[0] == 2
    assert sorted(_ids_and_texts(index)) == ["p0", "p1"] and IndexMeta.load(index).num_passages == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "index", "old.jsonl"]


def test_a_directory_of_other_files_is_never_replaced(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    code, _, err = _tandem_build(capsys, write_corpus(tmp_path / "c.jsonl", PASSAGES[:1]), tmp_path / "notes")
    assert code == 2 and "holds files a build does not write ('todo.txt')" in err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_build_index_as_a_library_raises_naming_the_line(tmp_path):
    corpus = _write_lines(tmp_path / "c.jsonl", [_record("a", "x"), _record("a", "y")])
    with pytest.raises(ValueError, match="appears on lines 1, 2"):
        build_index(corpus, tmp_path / "index", show_progress=False)


def test_an_interrupted_build_is_resumed_by_the_same_command(tmp_path):
    """The staging directory of a build of this corpus (as an interrupted build leaves it) is resumed:
    its passages are not encoded again; another corpus would discard it."""
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES[:4])
    build_index(corpus, tmp_path / "done", show_progress=False)
    (tmp_path / "done").rename(tmp_path / ".index.building")  # what a killed build of `index` left
    stats = build_index(corpus, tmp_path / "index", show_progress=False)
    assert (stats["num_indexed"], stats["num_skipped"], stats["num_in_index"]) == (0, 4, 4)
    assert not (tmp_path / ".index.building").exists() and len(_ids_and_texts(tmp_path / "index")) == 4


def test_a_corpus_that_is_a_symlink_loop_is_named_so(tmp_path, capsys):
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    code, _, err = _tandem_build(capsys, loop, tmp_path / "index")
    assert code == 2 and "symbolic link that loops" in err and "Traceback" not in err


def test_a_byte_order_mark_is_refused_as_in_a_question_file(tmp_path, capsys):
    """The question files refuse one (host/files.py); the corpus reader words it for the corpus."""
    corpus = _write_lines(tmp_path / "c.jsonl", [b"\xef\xbb\xbf" + _record("a", "Alaric Venn").encode()])
    code, _, err = _tandem_build(capsys, corpus, tmp_path / "index")
    assert code == 2 and "c.jsonl:1: the line starts with a byte-order mark" in err, err
    assert not (tmp_path / "index").exists()
