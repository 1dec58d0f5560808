"""The placement plan from cluster.* keys: nodes and GPUs per process, its errors, the weight-sync route,
the one-model-path rule and `tandem train --dry-run` (pure Python: no Ray, no GPUs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.cluster.placement import format_gpus, plan_placement
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GLM = ROOT / "examples/searchr1/config/train_glm4.7_flash_2node_async.yaml"


def plan(*overrides: str):
    config = load_config(None, ["retrieval.launch=false", *overrides])
    return config, plan_placement(config)


def test_glm_dry_run_prints_the_two_node_plan():
    result = subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", "train", str(GLM), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Ray places by node and picks the GPUs inside it: the plan promises counts, not ids (issue 42, item 13)
    assert "actor: 8 rank(s) in one torch.distributed group, 8 GPUs on node 0" in out
    assert "rollout: 2 sglang instance(s) of tensor_parallel_size 4, 8 GPUs on node 1" in out
    assert (
        "rollout SGLang server 0: node 1, 4 GPUs (Ray chooses which)" in out
        and "rollout SGLang server 1: node 1, 4 GPUs (Ray chooses which)" in out
    )
    assert (
        "rollout_buffer.max_inflight_groups = 77" in out and "rollout_buffer.max_buffered_groups = 256" in out
    )
    assert "weight sync: NCCL broadcast from actor rank 0 (node 0) to 2 engine(s) on node(s) 1" in out
    assert "rollout.pause_mode = retract (how the engines stand for each weight sync)" in out
    assert (
        "-m sglang.launch_server --model-path /path/to/GLM-4.7-Flash --tp-size 4 --mem-fraction-static 0.85"
        in out
    )
    assert "--port 30000" in out and "--port 30001" in out
    assert "actor.model.model_path derived: /path/to/GLM-4.7-Flash (= rollout.model.model_path)" in out


def test_global_gpu_ids_map_to_nodes_and_tensor_parallel_groups():
    _, p = plan(
        "cluster.num_nodes=2",
        "cluster.num_gpus_per_node=4",
        "actor.num_ranks=2",
        "rollout.backend=sglang",  # the embedded engine has no tensor parallelism
        "rollout.tensor_parallel_size=2",
        "cluster.component_placement={actor: '2-3', rollout: '4-7'}",
        "actor.device=cuda",
        "rollout.device=cuda",
    )
    assert [(a.node, a.gpus) for a in p.actor] == [(0, [2]), (0, [3])]
    assert [(e.node, e.gpus) for e in p.engines] == [(1, [0, 1]), (1, [2, 3])]
    assert p.weight_sync == "nccl" and not p.shares_gpu


def test_one_shared_gpu_is_cuda_ipc_and_cpu_is_gloo():
    _, shared = plan(
        "cluster.component_placement={'actor,rollout': '0'}", "actor.device=cuda", "rollout.device=cuda"
    )
    assert shared.shares_gpu and shared.weight_sync == "cuda_ipc"
    assert [(e.node, e.gpus) for e in shared.engines] == [(0, [0])]
    _, cpu = plan("actor.device=cpu", "rollout.device=cpu")
    assert cpu.weight_sync == "gloo" and cpu.actor[0].gpus == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "cluster.component_placement={actor: '0-8'}",
                "actor.num_ranks=9",
                "cluster.num_gpus_per_node=8",
            ],
            "names GPU 8, but the cluster has 8 GPUs",
        ),
        (
            [
                "cluster.num_nodes=2",
                "cluster.num_gpus_per_node=8",
                "rollout.backend=sglang",
                "rollout.tensor_parallel_size=4",
                "cluster.component_placement={actor: '0', rollout: '6-9'}",
            ],
            "would span nodes \\[0, 1\\]",
        ),
        (["cluster.component_placement={actor: '0-3'}", "actor.num_ranks=2"], "names 4 actor GPUs"),
        (
            ["cluster.component_placement={actor: '0-1', rollout: '1-2'}", "actor.num_ranks=2"],
            "overlapping GPUs under separate keys",
        ),
        (
            ["cluster.num_nodes=2", "cluster.component_placement={actor: '0', rollout: '1'}"],
            "cluster.num_gpus_per_node=0 with cluster.num_nodes=2",
        ),
        (
            ["cluster.retrieval_node=1", "retrieval.launch=true"],
            "cluster.retrieval_node=1 but cluster.num_nodes=1",
        ),
    ],
)
def test_placements_that_do_not_fit_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(*overrides)


def test_one_model_path():
    config = load_config(None, ["rollout.model.model_path=/m"])
    assert config.actor.model.model_path == "/m" and "actor.model.model_path" in config.derived
    with pytest.raises(ConfigError, match="actor.allow_different_model=true"):
        load_config(None, ["rollout.model.model_path=/m", "actor.model.model_path=/other"])
    config = load_config(
        None,
        ["rollout.model.model_path=/m", "actor.model.model_path=/other", "actor.allow_different_model=true"],
    )
    assert config.actor.model.model_path == "/other"


def test_format_gpus():
    assert [format_gpus(g) for g in ([0], [0, 1, 2, 3], [0, 2, 3, 7])] == ["0", "0-3", "0,2-3,7"]


def test_no_placement_on_one_gpu_machine_shares_gpu_0():
    """The H200 default: no component_placement, both on CUDA: actor and engine share GPU 0 (CUDA IPC)."""
    _, p = plan("actor.device=cuda", "rollout.device=cuda")
    assert p.shares_gpu and p.weight_sync == "cuda_ipc"
    assert [(a.node, a.gpus) for a in p.actor] == [(0, [0])] and [(e.node, e.gpus) for e in p.engines] == [
        (0, [0])
    ]


SHARED_GPU = (
    "actor.device=cuda",
    "rollout.device=cuda",
    "cluster.component_placement={'actor,rollout': '0'}",
)


@pytest.mark.parametrize(
    ("overrides", "policy", "why"),
    [
        (("runner.async_mode=true", "agentloop.task_name=t", *SHARED_GPU), "time_share", "share a GPU"),
        (("runner.async_mode=false", *SHARED_GPU), "concurrent", "sync runner never overlaps"),
        (
            (
                "runner.async_mode=true",
                "agentloop.task_name=t",
                "actor.device=cuda",
                "rollout.device=cuda",
                "cluster.component_placement={actor: '0', rollout: '1'}",
            ),
            "concurrent",
            "do not share a GPU",
        ),
        (
            ("runner.async_mode=true", "agentloop.task_name=t", "rollout.pause_mode=drain", *SHARED_GPU),
            "concurrent",
            "drain",
        ),
        (
            (
                "runner.async_mode=true",
                "agentloop.task_name=t",
                "cluster.mps=true",
                "cluster.mps_sm_percent={rollout: 30}",
                *SHARED_GPU,
            ),
            "concurrent",
            "mps_sm_percent",
        ),
        (
            (
                "runner.async_mode=true",
                "agentloop.task_name=t",
                "cluster.colocated_policy=concurrent",
                *SHARED_GPU,
            ),
            "concurrent",
            "set",
        ),
        (
            ("runner.async_mode=true", "agentloop.task_name=t", "cluster.colocated_policy=time_share"),
            "time_share",
            "set",
        ),
        (
            ("runner.async_mode=true", "agentloop.task_name=t", "cluster.mps=true", *SHARED_GPU),
            "concurrent",
            "MPS",
        ),
    ],
)
def test_colocated_policy_auto_time_shares_exactly_a_shared_gpu_in_async_mode(overrides, policy, why):
    from tandemrl.cluster.placement import describe_plan

    config, p = plan(*overrides)
    assert p.colocated_policy == policy
    line = next(line for line in describe_plan(config, p) if line.startswith("cluster.colocated_policy"))
    assert line.startswith(f"cluster.colocated_policy = {policy} (") and why in line, line
