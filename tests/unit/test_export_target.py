"""`tandem export CKPT --out DIR` replaces DIR whole, so it may only replace a directory that holds nothing
but what an export writes, and never one inside the checkpoint it reads (tandemrl/trainer/export.py). One
real checkpoint of a tiny actor, saved once; each refusal comes before the weights are loaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.cli import main
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.checkpoint import checkpoint_dir
from tandemrl.trainer.checkpoint_check import verify_checkpoint
from tandemrl.trainer.export import save_hf_dir
from tests.integration.trainer_helpers import cpu_actor_setup


@pytest.fixture(scope="module")
def saved(tiny_llama_dir, tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    actor = Actor(cpu_actor_setup(tiny_llama_dir))
    return actor.save_checkpoint(checkpoint_dir(tmp_path_factory.mktemp("saved"), 1))


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A copy of the saved checkpoint (hard links: the tests only add files, never rewrite one)."""
    target = tmp_path / "global_step_1"
    shutil.copytree(saved, target, copy_function=os.link)
    return target


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _export(capsys, ckpt: Path, out: Path | str) -> tuple[int, str]:
    code = main(["export", str(ckpt), "--out", str(out)])
    return code, capsys.readouterr().err


def test_a_model_directory_with_other_files_is_refused_and_kept(ckpt, tmp_path, capsys):
    out = tmp_path / "exported"
    assert _export(capsys, ckpt, out)[0] == 0
    (out / "notes.txt").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "results.jsonl").write_text('{"em": 0.5}\n')
    before = _tree(out)
    code, err = _export(capsys, ckpt, out)
    assert code == 2 and "'eval', 'notes.txt'" in err and "new or empty directory" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "global_step_1"]  # no staging left
    # once they are moved out, what an export wrote (a stale shard of an older, larger one too) is replaced
    shutil.rmtree(out / "eval")
    (out / "notes.txt").unlink()
    (out / "model-00003-of-00003.safetensors").write_bytes(b"from an older export")
    assert _export(capsys, ckpt, out)[0] == 0
    assert not (out / "model-00003-of-00003.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(out)  # the new model, whole


def test_many_foreign_entries_are_counted_not_all_listed(ckpt, tmp_path, capsys):
    out = tmp_path / "exported"
    out.mkdir()
    for i in range(40):
        (out / f"run-{i:02d}.log").write_text("x")
    code, err = _export(capsys, ckpt, out)
    assert (
        code == 2
        and "('run-00.log', 'run-01.log', 'run-02.log', 'run-03.log', 'run-04.log' and 35 more)" in err
    ), err
    assert len(list(out.iterdir())) == 40


@pytest.mark.parametrize("inside", ["actor/hf", "actor/exported", ".", "actor"])
def test_an_out_inside_the_checkpoint_is_refused_and_the_checkpoint_still_resumes(ckpt, capsys, inside):
    before = _tree(ckpt)
    code, err = _export(capsys, ckpt, ckpt / inside)
    assert code == 2 and "the checkpoint" in err and "outside it" in err, err
    assert _tree(ckpt) == before
    verify_checkpoint(ckpt, need_data=False)  # what a resume checks: no file the save did not write


def test_an_out_that_holds_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    code, err = _export(capsys, ckpt, tmp_path)
    assert code == 2 and "holds the checkpoint" in err, err
    assert (ckpt / "manifest.json").is_file()


@pytest.mark.parametrize("place", ["", ".", "..", "a_file/sub", "a_file/sub/deeper"])
def test_an_out_that_cannot_be_replaced_is_refused_in_one_line(ckpt, tmp_path, capsys, monkeypatch, place):
    """The current directory (an empty `--out` means it) cannot be renamed; a file cannot hold a folder."""
    work = tmp_path / "elsewhere" / "work"  # its parent does not hold the checkpoint
    work.mkdir(parents=True)
    (work / "a_file").write_text("mine")
    monkeypatch.chdir(work)
    code, err = _export(capsys, ckpt, place)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (
        ("current directory" in err)
        if "a_file" not in place
        else ("'a_file' is a file, not a directory" in err)
    )
    assert sorted(p.name for p in work.iterdir()) == ["a_file"] and (work / "a_file").read_text() == "mine"


def test_save_hf_dir_checks_again_before_the_swap(tiny_llama_dir, tmp_path):
    """A file put in the old model directory while the new one is written is not lost."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # no tied storage
    out = tmp_path / "coldstart"
    save_hf_dir(state, model.config, None, out)

    def late_writer():
        yield from state.items()
        (out / "notes.txt").write_text("written meanwhile")

    with pytest.raises(FileExistsError, match="notes.txt"):
        save_hf_dir(late_writer(), model.config, None, out)
    assert (out / "notes.txt").read_text() == "written meanwhile" and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coldstart"]
