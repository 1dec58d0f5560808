"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`), a custom resource standing in for GPUs:
the placement plan puts the actor on node 0 and the rollout engine on node 1, Ray places them there,
and one async step runs with tiny models and gloo weight sync between the two nodes' processes."""

from __future__ import annotations

import pytest

from tandemrl.config.loader import load_config
from tests.integration.runner_helpers import small_kb_once, tiny_overrides

FAKE_GPU = "tandem_test_gpu"


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {FAKE_GPU: 1}, "include_dashboard": False},
    )
    worker = cluster.add_node(num_cpus=2, resources={FAKE_GPU: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        yield cluster.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_actor_on_node_0_rollout_on_node_1_one_async_step(
    tmp_path, tiny_llama_dir, small_kb, two_node_cluster
):
    from tandemrl.commands.train import train

    head_id, worker_id = two_node_cluster
    kb_dir, index_dir = small_kb
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + [
        "runner.async_mode=true",
        "runner.max_steps=1",
        "runner.val_interval=0",
        "cluster.use_ray=true",
        "cluster.num_nodes=2",
        "cluster.num_gpus_per_node=1",
        f"cluster.gpu_resource={FAKE_GPU}",
        "cluster.component_placement={actor: '0', rollout: '1'}",
    ]
    config = load_config(None, overrides)
    ctx = train(config, write_plots=False)
    assert ctx.placed_nodes == {"actor rank 0": head_id, "rollout engine 0": worker_id}
    (url,) = [engine.base_url for engine in ctx.engines]
    assert not url.startswith("http://127.0.0.1"), f"engine on node 1 reports a loopback URL: {url}"
    assert ctx.weight_version == 1  # one step trained and its weights pushed over gloo to node 1's engine


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.num_nodes=3", "cluster.component_placement={actor: '0', rollout: '1'}"],
            "Ray reports 2 live",
        ),
        (
            [
                "cluster.num_nodes=2",
                "cluster.num_gpus_per_node=2",
                "cluster.component_placement={actor: '0', rollout: '2-3'}",
            ],
            f"GPUs 0-1 on node 1 .* but Ray reports 1 {FAKE_GPU} there",
        ),
    ],
)
def test_a_placement_ray_cannot_hold_is_refused_before_anything_starts(
    prepared_home, two_node_cluster, overrides, message
):
    """The embedded model of the prepared home: its path is checked before the placement is."""
    from tandemrl.config.schema import ConfigError
    from tandemrl.runner.services import Services

    base = ["cluster.use_ray=true", f"cluster.gpu_resource={FAKE_GPU}", "retrieval.launch=false"]
    config = load_config(None, [*base, "cluster.num_gpus_per_node=1", *overrides])
    services = Services(config)
    with pytest.raises(ConfigError, match=message):
        services.launch()
    assert services.group.handles == []
