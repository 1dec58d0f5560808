"""The actor's memory estimate (trainer/memory_estimate.py) and the dry run's lines on it
(commands/actor_memory.py): parameter counts from a meta-device build against the real model, the
per-rank arithmetic for one and two ranks, the load's host peak, and the warnings when the memory given
(injected, not this machine's) is too small."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeLiteConfig

from tandemrl.cluster.placement import plan_placement
from tandemrl.commands.actor_memory import MachineMemory, _gib, describe_actor_memory
from tandemrl.commands.train import dry_run
from tandemrl.config.loader import load_config
from tandemrl.trainer.memory_estimate import (
    LOAD_CHUNK_BYTES,
    ModelSize,
    actor_memory_per_rank,
    load_peak_host_bytes,
    measure_model,
)

ROOT = Path(__file__).resolve().parents[2]
GLM = ROOT / "examples/searchr1/config/train_glm4.7_flash_2node_async.yaml"
GIB = 2**30
SIZE = ModelSize(num_params=1_000_000, num_root_params=200_000, num_layer_params=50_000, num_layers=16)


def _tiny_glm_dir(tmp_path: Path) -> Path:
    """A GLM-4.7-Flash-shaped config (MLA attention, a dense first layer, then routed experts), tiny."""
    config = Glm4MoeLiteConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    config.save_pretrained(tmp_path / "glm")
    return tmp_path / "glm"


def _real_counts(model: torch.nn.Module) -> tuple[int, int, list[int]]:
    """(all parameters, those outside the decoder layers, each layer's) of a real model."""
    layers = model.base_model.layers
    in_layers = {id(p) for p in layers.parameters()}
    params = list(model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return sum(p.numel() for p in params), sum(p.numel() for p in params if id(p) not in in_layers), per_layer


@pytest.mark.parametrize("tied", [True, False])
def test_the_meta_count_is_the_real_models(tmp_path, smollm2_dir, tiny_model_factory, tied):
    from tests.tiny_models import make_tiny_model_dir

    if tied:
        model_dir = tiny_model_factory("llama")
    else:
        model_dir = make_tiny_model_dir(tmp_path / "untied", smollm2_dir, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    num_params, num_root, per_layer = _real_counts(model)
    size = measure_model(model_dir)
    assert (size.num_params, size.num_root_params) == (num_params, num_root)
    assert (size.num_layer_params, size.num_layers) == (max(per_layer), 2)
    embeddings = model.get_input_embeddings().weight.numel()
    # tied: the lm_head is the embedding, counted once; untied: it is a root parameter of its own
    assert size.num_root_params - embeddings == (0 if tied else embeddings) + model.config.hidden_size


def test_the_meta_count_of_a_glm_moe_model_is_the_real_models(tmp_path):
    model_dir = _tiny_glm_dir(tmp_path)
    real = AutoModelForCausalLM.from_config(
        Glm4MoeLiteConfig.from_pretrained(model_dir)
    )  # random weights, CPU
    num_params, num_root, per_layer = _real_counts(real)
    size = measure_model(model_dir)
    assert (size.num_params, size.num_root_params, size.num_layer_params) == (
        num_params,
        num_root,
        max(per_layer),
    )
    assert (
        per_layer[1] > per_layer[0]
    )  # the largest layer is one with experts: all of them are its parameters


def test_two_ranks_hold_half_the_sharded_state_and_gather_one_layer_and_the_root():
    one, two = (actor_memory_per_rank(SIZE, n, compute_bytes=2) for n in (1, 2))
    assert (one.weights, one.gradients, one.optimizer) == (4_000_000, 4_000_000, 8_000_000)
    assert (two.weights, two.gradients, two.optimizer) == (2_000_000, 2_000_000, 4_000_000)
    # one rank: the plain module, bf16 autocast copies of every weight; no FSDP gathers
    assert (one.autocast_copies, one.gathered_layer, one.gathered_root) == (2_000_000, 0, 0)
    # two ranks: the largest layer and the root, gathered in bf16
    assert (two.autocast_copies, two.gathered_layer, two.gathered_root) == (0, 100_000, 400_000)
    assert two.total == 8_000_000 + 100_000 + 400_000 and one.total == 18_000_000
    fp32 = actor_memory_per_rank(SIZE, 2, compute_bytes=4)
    assert (fp32.gathered_layer, fp32.gathered_root) == (200_000, 800_000)
    assert actor_memory_per_rank(SIZE, 1, compute_bytes=4).autocast_copies == 0  # fp32 casts nothing
    eight = actor_memory_per_rank(SIZE, 8, compute_bytes=2)
    assert eight.weights == math.ceil(4_000_000 / 8) and eight.gathered_root == two.gathered_root


def test_the_reference_model_adds_its_sharded_fp32_weights_only():
    plain, with_ref = (actor_memory_per_rank(SIZE, 2, 2, has_reference=ref) for ref in (False, True))
    assert with_ref.reference == plain.weights == 2_000_000
    assert with_ref.total - plain.total == with_ref.reference
    with pytest.raises(ValueError):
        actor_memory_per_rank(SIZE, 0, 2)


def test_the_loads_host_peak_follows_the_loader():
    """One rank: the whole fp32 model (twice with a reference model); several: one chunk in flight per rank,
    and the shards only where they live on the host (trainer/loading.py)."""
    from tandemrl.trainer.loading import CHUNK_BYTES

    assert LOAD_CHUNK_BYTES == CHUNK_BYTES
    one = load_peak_host_bytes(SIZE, 1, 1)
    assert one == 4 * SIZE.num_params
    assert load_peak_host_bytes(SIZE, 1, 1, has_reference=True) == 2 * one
    on_gpu = load_peak_host_bytes(SIZE, 8, 8)
    assert on_gpu == 8 * CHUNK_BYTES
    assert load_peak_host_bytes(SIZE, 4, 8) == on_gpu // 2
    assert load_peak_host_bytes(SIZE, 8, 8, shards_on_host=True) == on_gpu + 4 * SIZE.num_params  # 8 x 1/8
    shards = load_peak_host_bytes(SIZE, 4, 8, has_reference=True, shards_on_host=True)
    assert shards - load_peak_host_bytes(SIZE, 4, 8) == 2 * 4 * SIZE.num_params // 2


def test_dry_run_prints_the_estimate_for_a_tiny_model(capsys, tiny_llama_dir):
    config = load_config(None, [f"rollout.model.model_path={tiny_llama_dir}", "actor.num_ranks=2"])
    assert dry_run(config) == 0
    out = capsys.readouterr().out
    size = measure_model(tiny_llama_dir)
    weights_mib = 4 * size.num_params / 2 / 2**20
    line = next(line for line in out.splitlines() if line.startswith("actor memory per rank"))
    assert line.startswith(
        f"actor memory per rank (estimate, 2 ranks, fp32 compute, fp32 masters): weights {weights_mib:.2f} MiB, "
        f"gradients {weights_mib:.2f} MiB, optimizer {2 * weights_mib:.2f} MiB, gathered layer "
    )
    assert "; CPU ranks: " in line
    load = _gib(load_peak_host_bytes(size, 2, 2, shards_on_host=True))
    assert (
        f"load: up to {load} of host memory on node 0 (rank 0 streams the checkpoint into every "
        "rank's shards, held on the host)" in out
    )
    assert f"actor model: {size.num_params / 1e6:.2f} M parameters" in out


def _gpu_plan(*overrides: str):
    config = load_config(
        None,
        [
            "retrieval.launch=false",
            "actor.num_ranks=2",
            "actor.device=cuda",
            "actor.dtype=bfloat16",
            "rollout.device=cuda",
            *overrides,
        ],
    )
    return config, plan_placement(config)


def test_warnings_fire_when_a_gpu_or_the_host_cannot_hold_the_actor(caplog, tiny_llama_dir):
    config, plan = _gpu_plan(
        f"rollout.model.model_path={tiny_llama_dir}",
        "cluster.component_placement={actor: '0-1', rollout: '2'}",
    )
    roomy = describe_actor_memory(
        config, plan, MachineMemory(host_bytes=64 * GIB, gpu_bytes=80 * GIB, gpu_name="GPU 0")
    )
    assert not [line for line in roomy if line.startswith("warning:")]
    assert any(line.endswith(" of 80.00 GiB (GPU 0)") for line in roomy)
    with caplog.at_level(logging.WARNING, logger="tandemrl.commands.actor_memory"):
        tight = describe_actor_memory(
            config, plan, MachineMemory(host_bytes=2**20, gpu_bytes=2**20, gpu_name="GPU 0")
        )
    warnings = [line for line in tight if line.startswith("warning:")]
    assert len(warnings) == 2
    assert "exceeds the 1.00 MiB of GPU 0" in warnings[0] and "actor.num_ranks" in warnings[0]
    assert "host memory on node 0 (2 rank(s)" in warnings[1]
    assert [r.getMessage() for r in caplog.records] == [w.removeprefix("warning: ") for w in warnings]


def test_a_shared_gpu_leaves_the_engines_configured_share_out(tiny_llama_dir):
    config, plan = _gpu_plan(
        f"rollout.model.model_path={tiny_llama_dir}",
        "cluster.component_placement={'actor,rollout': '0-1'}",
        "rollout.backend=sglang",
        "rollout.sglang.mem_fraction_static=0.85",
    )
    total = actor_memory_per_rank(measure_model(tiny_llama_dir), 2, 2).total
    gpu = int(total / 0.5)  # holds the actor alone, not beside an engine taking 85 % of it
    lines = describe_actor_memory(
        config, plan, MachineMemory(host_bytes=64 * GIB, gpu_bytes=gpu, gpu_name="GPU 0")
    )
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "rollout.sglang.mem_fraction_static=0.85 left out" in warnings[0]


def test_other_nodes_memory_is_said_to_be_unknown(tiny_llama_dir):
    config, plan = _gpu_plan(
        f"rollout.model.model_path={tiny_llama_dir}",
        "cluster.num_nodes=2",
        "cluster.num_gpus_per_node=2",
        "cluster.component_placement={actor: '2-3', rollout: '0'}",
    )
    lines = describe_actor_memory(
        config, plan, MachineMemory(host_bytes=2**20, gpu_bytes=2**20, gpu_name="GPU 0")
    )
    assert any(line.endswith("; node(s) 1: GPU memory unknown from here") for line in lines)
    assert any(line.endswith("node 1's host memory is unknown from here") for line in lines)
    assert not [line for line in lines if line.startswith("warning:")]  # nothing claimed of node 0's memory


def test_an_unreadable_model_config_is_one_line(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    for path, needle in (
        (broken, f"estimate unavailable for {broken}: ValueError"),
        (tmp_path / "none", "has no config.json"),
    ):
        config = load_config(None, ["retrieval.launch=false", f"rollout.model.model_path={path}"])
        lines = describe_actor_memory(config, plan_placement(config), MachineMemory(host_bytes=GIB))
        assert (
            len(lines) == 1
            and lines[0].startswith("actor memory: estimate unavailable")
            and needle in lines[0]
        )


def test_the_glm_recipe_says_the_estimate_needs_the_models_config(capsys):
    assert dry_run(load_config(GLM)) == 0
    out = capsys.readouterr().out
    assert (
        "actor memory: estimate unavailable, it needs the model's config.json: /path/to/GLM-4.7-Flash has no "
        "config.json" in out
    )


def test_the_glm_recipe_with_a_local_config_prints_its_estimate(capsys, tmp_path):
    """The recipe's placement (8 ranks on node 0, bf16) over a tiny GLM-shaped config.json: the estimate
    comes from the config alone (the directory has no weights)."""
    model_dir = _tiny_glm_dir(tmp_path)
    assert not list(model_dir.glob("*.safetensors"))
    assert dry_run(load_config(GLM, [f"rollout.model.model_path={model_dir}"])) == 0
    out = capsys.readouterr().out
    assert "actor memory per rank (estimate, 8 ranks, bf16 compute, fp32 masters): weights " in out
    size = measure_model(model_dir)
    assert f"load: up to {_gib(load_peak_host_bytes(size, 8, 8))} of host memory on node 0" in out


def test_offload_moves_the_sharded_state_to_the_host():
    """actor.cpu_offload: weights, gradients, optimizer state and a reference model on the host; the GPU holds
    what FSDP gathers (one layer and the root), on one rank too."""
    plain = actor_memory_per_rank(SIZE, 1, 2, has_reference=True)
    offloaded = actor_memory_per_rank(SIZE, 1, 2, has_reference=True, offload=True)
    assert offloaded.host == plain.weights + plain.gradients + plain.optimizer + plain.reference
    assert offloaded.total == offloaded.gathered_layer + offloaded.gathered_root > 0
    assert offloaded.autocast_copies == 0 and offloaded.total < plain.total
    assert plain.host == 0


def test_offloaded_state_is_checked_against_node_0s_host_memory(tiny_llama_dir):
    """actor.cpu_offload: the dry run says how much state the node's host holds for the whole run, and
    warns where the machine has less (the GPU would hold only what FSDP gathers)."""
    config, plan = _gpu_plan(
        f"rollout.model.model_path={tiny_llama_dir}",
        "cluster.component_placement={actor: '0-1', rollout: '2'}",
        "actor.cpu_offload=true",
    )
    memory = actor_memory_per_rank(measure_model(tiny_llama_dir), 2, 2, offload=True)
    held = 2 * memory.host
    roomy = describe_actor_memory(config, plan, MachineMemory(host_bytes=64 * GIB, gpu_bytes=80 * GIB))
    assert any(f"; offloaded state {_gib(held)} on node 0's host, of 64.00 GiB" in line for line in roomy)
    assert not [line for line in roomy if line.startswith("warning:")]
    tight = describe_actor_memory(config, plan, MachineMemory(host_bytes=held - 1, gpu_bytes=80 * GIB))
    warnings = [line for line in tight if line.startswith("warning:")]
    assert any("actor.cpu_offload keeps an estimated" in w and "actor.param_dtype" in w for w in warnings)


def test_bf16_weights_and_moments_shrink_the_sharded_state():
    """actor.param_dtype=bfloat16: weights, gradients and a reference model in 2 bytes, AdamW's moments
    fp32 (12 bytes a parameter in all) or bf16 (8); no autocast copies, since bf16 weights compute as they
    are; the gathered layer and root in the compute dtype as before."""
    from tandemrl.trainer.memory_estimate import BYTES_PER_PARAM

    assert BYTES_PER_PARAM == {
        ("float32", "float32"): 16,
        ("float32", "bfloat16"): 12,
        ("bfloat16", "float32"): 12,
        ("bfloat16", "bfloat16"): 8,
    }
    fp32 = actor_memory_per_rank(SIZE, 2, 2, has_reference=True)
    bf16 = actor_memory_per_rank(SIZE, 2, 2, has_reference=True, param_bytes=2)
    both = actor_memory_per_rank(SIZE, 2, 2, has_reference=True, param_bytes=2, state_bytes=2)
    num = SIZE.num_params // 2  # per rank
    assert (fp32.weights, fp32.gradients, fp32.optimizer, fp32.reference) == (
        4 * num,
        4 * num,
        8 * num,
        4 * num,
    )
    assert (bf16.weights, bf16.gradients, bf16.optimizer, bf16.reference) == (
        2 * num,
        2 * num,
        8 * num,
        2 * num,
    )
    assert (both.weights, both.gradients, both.optimizer) == (2 * num, 2 * num, 4 * num)
    assert (bf16.gathered_layer, bf16.gathered_root) == (fp32.gathered_layer, fp32.gathered_root)
    one = actor_memory_per_rank(SIZE, 1, 2, param_bytes=2)
    assert one.autocast_copies == 0 and one.total == 12 * SIZE.num_params
    assert actor_memory_per_rank(SIZE, 1, 2).autocast_copies == 2 * SIZE.num_params
    with pytest.raises(ValueError, match="bf16 weights compute in bf16"):
        actor_memory_per_rank(SIZE, 1, compute_bytes=4, param_bytes=2)
    assert load_peak_host_bytes(SIZE, 1, 1, param_bytes=2) == load_peak_host_bytes(SIZE, 1, 1) // 2
    on_host = load_peak_host_bytes(SIZE, 2, 2, shards_on_host=True, param_bytes=2)
    assert on_host - load_peak_host_bytes(SIZE, 2, 2) == 2 * SIZE.num_params  # 2 ranks x half in bf16


def test_dry_run_names_bf16_weights_and_moments(capsys, tiny_llama_dir):
    config = load_config(
        None,
        [
            f"rollout.model.model_path={tiny_llama_dir}",
            "actor.param_dtype=bfloat16",
            "actor.optim.state_dtype=bfloat16",
        ],
    )
    assert dry_run(config) == 0
    out = capsys.readouterr().out
    num_params = measure_model(tiny_llama_dir).num_params
    line = next(line for line in out.splitlines() if line.startswith("actor memory per rank"))
    weights_mib = 2 * num_params / 2**20
    assert line.startswith(
        "actor memory per rank (estimate, 1 rank, bf16 compute, bf16 weights, bf16 AdamW moments): "
        f"weights {weights_mib:.2f} MiB, gradients {weights_mib:.2f} MiB, optimizer {2 * weights_mib:.2f} MiB; "
        f"total {4 * weights_mib:.2f} MiB"
    )
    assert "(one rank loads the full model in bf16)" in out
