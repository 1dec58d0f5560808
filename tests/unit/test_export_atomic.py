"""An export (the cold start's model, `tandem export`) replaces a model directory only once the new one is
whole: a failed or interrupted write leaves the old model as it was (tandemrl/trainer/export.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.trainer import export
from tandemrl.trainer.export import save_hf_dir


def _state_and_config(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v + 1.0 for k, v in model.state_dict().items()}, model.config


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_an_export_replaces_the_old_model_whole(tiny_llama_dir, tmp_path):
    out = tmp_path / "coldstart"
    state, config = _state_and_config(tiny_llama_dir)
    save_hf_dir({k: v * 0 for k, v in state.items()}, config, None, out)  # an older export
    (out / "model-00002-of-00002.safetensors").write_text("from an older export")
    save_hf_dir(state, config, tiny_llama_dir, out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    assert not (out / "model-00002-of-00002.safetensors").exists() and (out / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coldstart"]  # no staging left behind


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_interrupted_export_leaves_the_old_model(tiny_llama_dir, tmp_path, monkeypatch, error):
    out = tmp_path / "coldstart"
    state, config = _state_and_config(tiny_llama_dir)
    save_hf_dir(state, config, tiny_llama_dir, out)
    before = _files(out)

    def half_written(tensors, path):
        path.write_bytes(b"truncated")
        raise error

    monkeypatch.setattr(export, "_save_shard", half_written)
    with pytest.raises(type(error) if isinstance(error, BaseException) else error):
        save_hf_dir({k: v * 0 for k, v in state.items()}, config, tiny_llama_dir, out)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coldstart"]


def test_an_export_never_replaces_a_directory_that_holds_no_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "models"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    state, config = _state_and_config(tiny_llama_dir)
    with pytest.raises(FileExistsError, match="holds files an export does not write"):
        save_hf_dir(state, config, tiny_llama_dir, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_sft_refuses_a_directory_it_would_wipe_before_any_work(tmp_path, capsys):
    from tandemrl import cli

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a model")
    config = Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml"
    assert cli.main(["sft", str(config), f"actor.sft.out_dir={mine}"]) == 2
    assert "'notes.txt'" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_streamed_export_is_sharded_and_drains_its_input(tiny_llama_dir, tmp_path, monkeypatch):
    """Pairs stream in (as the actor's ranks gather them): shards of about SHARD_BYTES with HF's index, the
    same weights back through from_pretrained; and a failed write still consumes every pair, so ranks that
    gather in lockstep with the writer are never left waiting."""
    state, config = _state_and_config(tiny_llama_dir)
    monkeypatch.setattr(export, "SHARD_BYTES", 2**20)  # this model's ~12 MiB in several files
    out = save_hf_dir(iter(state.items()), config, tiny_llama_dir, tmp_path / "sharded")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    consumed = []

    def pairs():
        for name, tensor in state.items():
            consumed.append(name)
            yield name, tensor[:1] if name.endswith("norm.weight") else tensor  # a wrong shape midway

    with pytest.raises(ValueError, match="not in the model config"):
        save_hf_dir(pairs(), config, tiny_llama_dir, tmp_path / "wrong")
    assert consumed == list(state) and not (tmp_path / "wrong").exists()
