"""`tandem prepare kb --out`: refused arguments create nothing, a folder of other files is never written
into, an earlier KB is rewritten in place, and an interrupted generation leaves the folder as it was."""

from __future__ import annotations

import json

import pytest

import tandemrl.data.kb as kb
from tandemrl.cli import main
from tandemrl.data.kb import KB_FILES, generate_kb, kb_is_complete
from tandemrl.data.kb_entities import MAX_ENTITIES, build_world

TINY = {"num_entities": 40, "num_train": 30, "num_val": 4, "num_test": 4}


def prepare_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["prepare", "kb", *args])
    return code, capsys.readouterr().err


def test_empty_out_is_refused_and_the_working_directory_untouched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("mine\n")
    for out in ("", "  "):
        code, err = prepare_cli(capsys, "--out", out, "--num-entities", "40")
        assert code == 2 and "--out is empty" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]
    assert (tmp_path / "train.jsonl").read_text() == "mine\n"


@pytest.mark.parametrize(("num", "says"), [("3", "at least 20"), ("1000000000", f"at most {MAX_ENTITIES}")])
def test_refused_num_entities_creates_no_folder(tmp_path, capsys, num, says):
    out = tmp_path / "new" / "kb"
    code, err = prepare_cli(capsys, "--out", str(out), "--num-entities", num)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def test_upper_bound_is_checked_before_any_work():
    with pytest.raises(ValueError, match=f"at most {MAX_ENTITIES}"):
        build_world(0, MAX_ENTITIES + 1)


def test_folder_with_a_users_split_file_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "train.jsonl").write_text('{"id": "mine"}\n')
    code, err = prepare_cli(capsys, "--out", str(out), "--num-entities", "40")
    assert code == 2 and "no kb_meta.json" in err
    assert (out / "train.jsonl").read_text() == '{"id": "mine"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no folder staged beside it is left


def test_earlier_kb_with_another_file_is_refused(tmp_path, capsys):
    out = generate_kb(tmp_path / "kb", seed=0, **TINY)
    (out / "notes.txt").write_text("keep\n")
    before = (out / "train.jsonl").read_bytes()
    code, err = prepare_cli(capsys, "--out", str(out), "--num-entities", "60", "--seed", "1")
    assert code == 2 and "notes.txt" in err
    assert (out / "train.jsonl").read_bytes() == before and (out / "notes.txt").read_text() == "keep\n"


def test_out_that_is_a_file_or_under_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    for out in (path, path / "kb"):
        code, err = prepare_cli(capsys, "--out", str(out), "--num-entities", "40")
        assert code == 2 and "is a file" in err
    assert path.read_text() == "x"


def test_earlier_kb_is_rewritten_in_place(tmp_path, capsys):
    out = generate_kb(tmp_path / "kb", seed=0, **TINY)
    code, err = prepare_cli(capsys, "--out", str(out), "--num-entities", "60", "--seed", "1")
    assert code == 0, err
    meta = json.loads((out / "kb_meta.json").read_text())
    assert (meta["seed"], meta["num_entities"]) == (1, 60)
    assert sorted(p.name for p in out.iterdir()) == sorted(KB_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]


def test_interrupted_generation_leaves_the_earlier_kb(tmp_path, monkeypatch):
    out = generate_kb(tmp_path / "kb", seed=0, **TINY)
    before = {name: (out / name).read_bytes() for name in KB_FILES}
    calls = []

    def interrupted(path, records):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_write(path, records)

    real_write = kb._write_jsonl
    monkeypatch.setattr(kb, "_write_jsonl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate_kb(out, seed=5, **TINY)
    assert {name: (out / name).read_bytes() for name in KB_FILES} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]  # the staging folder is gone


def test_default_kb_folder_redoes_an_interrupted_kb(tmp_path):
    out = tmp_path / "seed0"
    out.mkdir()
    (out / "corpus.jsonl").write_text("half\n")  # an older version's interrupted run: no kb_meta.json
    (out / "train.jsonl.tmp").write_text("half\n")
    with pytest.raises(ValueError, match="no kb_meta.json"):
        generate_kb(out, seed=0, **TINY)
    generate_kb(out, seed=0, is_partial_ok=True, **TINY)
    assert kb_is_complete(out) and sorted(p.name for p in out.iterdir()) == sorted(KB_FILES)


@pytest.mark.parametrize("seed", [6, 9])
def test_seeds_that_ran_out_of_organisation_names_generate(seed):
    # these seeds drew a popular organisation core with all 16 suffixes taken before any other name space
    # filled: 18 of 100 seeds failed at the default 5,000 entities with "name space exhausted"
    world = build_world(seed, 5000)
    orgs = [e.name for e in world.values() if e.kind == "org"]
    assert len(orgs) == len(set(orgs)) == 850
