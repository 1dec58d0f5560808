"""The actor's loading across ranks (`trainer/loading.py`): 2 gloo ranks build the model on the meta device and
rank 0 streams the checkpoint into both ranks' shards. They end with exactly `from_pretrained`'s weights and
buffers, from safetensors and through the fallback (a checkpoint stored otherwise), the reference model
(`algorithm.kl_coef > 0`) too, and export them again streamed (`Actor.export_hf`). The load's host memory:
test_actor_ranks_ray.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandemrl.trainer.loading import build_on_meta, read_config, tied_names
from tests.conftest import free_port
from tests.integration.trainer_helpers import cpu_actor_setup, join_as_rank, leave_together


def _weights_worker(rank: int, port: int, model_dir: str, out_file: str) -> None:
    """Both ranks build the actor with a reference model; rank 0 saves both models' full weights and
    buffers."""
    join_as_rank(rank, 2, port)
    from tandemrl.trainer.actor import Actor

    actor = Actor(cpu_actor_setup(Path(model_dir), "algorithm.kl_coef=0.1"))
    policy = dict(actor.iter_full_weights(torch.float32))
    reference = {
        name: tensor.full_tensor().clone() for name, tensor in actor.ref_policy.hf.state_dict().items()
    }
    buffers = {name: buffer.clone() for name, buffer in actor.policy.hf.named_buffers()}
    if rank == 0:
        torch.save({"policy": policy, "reference": reference, "buffers": buffers}, out_file)
    actor.export_hf(Path(out_file).parent / "exported")  # every rank gathers, rank 0 writes
    leave_together()


def _spawn(worker, *args) -> None:
    mp.spawn(worker, args=(free_port(), *map(str, args)), nprocs=2, join=True)


def _reference_state(model_dir: Path) -> tuple[dict, dict]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict(), dict(model.named_buffers())


@pytest.mark.parametrize("stored", ["as_the_model", "without_prefix"])
def test_two_ranks_load_exactly_the_checkpoint(tiny_llama_dir, tmp_path, stored):
    """`without_prefix`: tensor names without the base model's `model.` (transformers adds it back on load), so
    the model's names are not in the file and loading takes the fallback (rank 0's `from_pretrained`)."""
    model_dir = tiny_llama_dir
    if stored == "without_prefix":
        model_dir = tmp_path / "renamed"
        model_dir.mkdir()
        state = load_file(tiny_llama_dir / "model.safetensors")
        save_file({k.removeprefix("model."): v for k, v in state.items()}, model_dir / "model.safetensors")
        for path in tiny_llama_dir.iterdir():
            if path.suffix != ".safetensors":
                (model_dir / path.name).write_bytes(path.read_bytes())
    _spawn(_weights_worker, model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    state, buffers = _reference_state(tiny_llama_dir)
    assert set(got["policy"]) == set(state) - {"lm_head.weight"}  # full weights list a tie once
    assert set(got["reference"]) == set(state)
    for name, tensor in state.items():
        assert torch.equal(got["reference"][name], tensor), f"reference {name}"
        if name in got["policy"]:
            assert torch.equal(got["policy"][name], tensor), name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in state.items())
    assert set(got["buffers"]) == set(buffers) and buffers  # the rotary frequencies, never in the file
    for name, buffer in buffers.items():
        assert torch.equal(got["buffers"][name], buffer), name


def test_meta_model_has_real_buffers_and_keeps_its_ties(tiny_llama_dir):
    model = build_on_meta(read_config(tiny_llama_dir), "sdpa")
    assert all(p.device.type == "meta" for p in model.parameters())
    real = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for (name, buffer), (real_name, value) in zip(model.named_buffers(), real.named_buffers(), strict=True):
        assert name == real_name and buffer.device.type == "cpu" and torch.equal(buffer, value), name
    assert tied_names(model) == {"lm_head.weight"}  # the tiny model ties its embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
