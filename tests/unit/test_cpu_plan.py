"""`cluster.cpu_pinning` (cluster/cpus.py): which cores each actor rank and each engine keep, what the
rest of the run shares, and the refusals, on plans built from real configs."""

from __future__ import annotations

import pytest

from tandemrl.cluster.cpus import MIN_SHARED_AUTO, plan_cpus
from tandemrl.cluster.placement import plan_placement
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.host.cpus import id_ranges

SIXTEEN = list(range(16))


def _plan(*overrides: str):
    config = load_config(None, list(overrides))
    return config, plan_placement(config)


def _shared_gpu(*overrides: str):
    return _plan(
        "cluster.num_gpus_per_node=1",
        "cluster.component_placement={'actor,rollout': 0}",
        "actor.device=cuda",
        "rollout.device=cuda",
        *overrides,
    )


def test_auto_on_a_shared_gpu_reserves_the_top_cores_for_the_actor_then_the_engine():
    config, plan = _shared_gpu()
    assert plan.shares_gpu
    cpu_plan, why = plan_cpus(config, plan, SIXTEEN)
    assert why.startswith("on (auto")
    assert cpu_plan.actor == ((14, 15),)
    assert cpu_plan.engines == ((12, 13),)
    assert cpu_plan.shared == tuple(range(12))
    assert cpu_plan.describe()[-1] == "  driver, retrieval server, Ray: cores 0-11"


def test_the_counts_come_from_their_keys_and_an_engine_may_share():
    config, plan = _shared_gpu("cluster.cpus_per_actor_rank=3", "cluster.cpus_per_engine=0")
    cpu_plan, _ = plan_cpus(config, plan, SIXTEEN)
    assert cpu_plan.actor == ((13, 14, 15),)
    assert cpu_plan.engines == ((),)
    assert cpu_plan.shared == tuple(range(13))
    assert "rollout engine 0: shared cores" in "\n".join(cpu_plan.describe())


def test_auto_respects_the_cores_the_driver_was_given():
    config, plan = _shared_gpu()
    given = [2, 3, 5, 8, 9, 10, 11, 12]  # a taskset or cpuset narrowed the driver to these
    cpu_plan, _ = plan_cpus(config, plan, given)
    assert cpu_plan.actor == ((11, 12),) and cpu_plan.engines == ((9, 10),)
    assert id_ranges(cpu_plan.shared) == "2-3,5,8"


def test_auto_stays_off_where_it_would_starve_the_rest_of_the_run():
    config, plan = _shared_gpu()
    cpu_plan, why = plan_cpus(config, plan, list(range(4 + MIN_SHARED_AUTO - 1)))
    assert cpu_plan is None
    assert why.startswith("off (auto:") and "cluster.cpus_per_actor_rank=2" in why


def test_auto_is_off_when_nothing_shares_a_gpu():
    config, plan = _plan()  # the CPU defaults: no GPU at all
    cpu_plan, why = plan_cpus(config, plan, SIXTEEN)
    assert cpu_plan is None and "do not share a GPU" in why


def test_always_pins_without_a_shared_gpu_and_never_turns_it_off():
    config, plan = _plan(
        "cluster.cpu_pinning=always", "cluster.cpus_per_actor_rank=1", "cluster.cpus_per_engine=0"
    )
    cpu_plan, why = plan_cpus(config, plan, [0, 1])
    assert why == "always (set)" and cpu_plan.actor == ((1,),) and cpu_plan.shared == (0,)
    config, plan = _shared_gpu("cluster.cpu_pinning=never")
    assert plan_cpus(config, plan, SIXTEEN) == (None, "never (set)")


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["cluster.cpus_per_actor_rank=2"], "of this machine's 2 would leave 0"),
        (["cluster.use_ray=false"], "cluster.use_ray=false"),
    ],
)
def test_always_refuses_what_it_cannot_honour_naming_why(overrides, names):
    config, plan = _plan("cluster.cpu_pinning=always", *overrides)
    with pytest.raises(ConfigError, match="cluster.cpu_pinning=always") as error:
        plan_cpus(config, plan, [0, 1])
    assert names in str(error.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cluster.cpu_pinning=on", "cluster.cpu_pinning"),  # YAML's `on` is a boolean: refused, named
        ("cluster.cpu_pinning=pinned", "cluster.cpu_pinning"),
        ("cluster.cpus_per_actor_rank=0", "cluster.cpus_per_actor_rank"),
        ("cluster.cpus_per_engine=-1", "cluster.cpus_per_engine"),
        ("cluster.cpus_per_engine=1000", "cluster.cpus_per_engine"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


@pytest.mark.parametrize("value", [-1, 1025])
def test_retrieval_num_threads_out_of_range_names_its_key(value):
    with pytest.raises(ConfigError, match="retrieval.num_threads"):
        load_config(None, [f"retrieval.num_threads={value}"])


def test_the_runs_retrieval_server_gets_the_configured_threads():
    from tandemrl.cluster.server_supervisor import ServerSpec, build_server

    config = load_config(None, ["retrieval.num_threads=3"])
    server = build_server(ServerSpec("retrieval", 0, config, index_dir="/nonexistent/index"), "127.0.0.1")
    assert server.server_args()[-2:] == ["--num-threads", "3"]
    assert server.env["OPENBLAS_NUM_THREADS"] == "3"
    assert load_config(None, []).retrieval.num_threads == 4


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_launched_vllm_or_sglang_server_keeps_the_shared_cores_unless_told(backend):
    """vLLM's API server, engine core and compile workers are processes of their own: on 2 pinned cores its
    first start took 247 s on an H100. The actor keeps its own cores."""
    config, plan = _shared_gpu(f"rollout.backend={backend}")
    assert (
        config.cluster.cpus_per_engine == 0 and "left to the OS" in config.derived["cluster.cpus_per_engine"]
    )
    cpu_plan, why = plan_cpus(config, plan, SIXTEEN)
    assert why.startswith("on (auto") and cpu_plan.actor == ((14, 15),)
    assert cpu_plan.engines == ((),) and cpu_plan.shared == tuple(range(14))
    config, plan = _shared_gpu(f"rollout.backend={backend}", "cluster.cpus_per_engine=2")
    assert plan_cpus(config, plan, SIXTEEN)[0].engines == ((12, 13),)
    assert "cluster.cpus_per_engine" not in config.derived
