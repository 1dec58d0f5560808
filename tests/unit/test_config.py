"""Every validation rule and every derivation of the configuration (docs/DESIGN.md, Configuration)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.commands.show import render
from tandemrl.config.derive import derive_and_validate, parse_gpu_range
from tandemrl.config.loader import apply_override, load_config
from tandemrl.config.schema import ConfigError, TandemConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "searchr1" / "config"
GLM = CONFIGS / "train_glm4.7_flash_2node_async.yaml"
ASYNC = CONFIGS / "embedded_cpu_async.yaml"
SYNC = CONFIGS / "embedded_cpu_sync.yaml"


def test_defaults_match_spec():
    config = load_config(None)
    assert config.runner.async_mode is False
    assert config.agentloop.max_turns == 4
    assert config.agentloop.max_actor_accept_staleness is None
    assert config.rollout.pause_mode == "retract"
    assert config.rollout.backend == "embedded"
    assert config.rollout.sglang.backend_type == "server"
    assert config.rollout.instances == 1 and config.rollout.tensor_parallel_size == 1
    assert config.down_sampling.down_sampling_config.reject_equal_reward is False
    assert (config.algorithm.group_size, config.algorithm.n_minibatches) == (4, 4)
    assert config.algorithm.recompute_logprobs is False
    assert config.tools.search.server_addr == "127.0.0.1:8000" and config.tools.search.topk == 3
    assert config.runner.output_dir.startswith("runs/searchr1-")


@pytest.mark.parametrize("path", [GLM, ASYNC, SYNC])
def test_example_configs_load(path):
    config = load_config(path)
    assert isinstance(config, TandemConfig)


def test_reference_recipe_derives_77_and_256():
    config = load_config(GLM)
    assert config.rollout.instances == 2
    assert config.rollout_buffer.max_inflight_groups == 77
    assert config.rollout_buffer.max_buffered_groups == 256
    assert config.rollout_buffer.max_dropped_groups_per_step == 1280
    for key in (
        "rollout_buffer.max_inflight_groups",
        "rollout_buffer.max_buffered_groups",
        "rollout_buffer.max_dropped_groups_per_step",
        "rollout.instances",
    ):
        assert key in config.derived
    shown = render(config)
    assert "max_inflight_groups: 77  # derived" in shown
    assert "max_buffered_groups: 256  # derived" in shown


def test_inflight_derivation_rounds_up():
    config = load_config(
        None, ["rollout.max_running_requests=10", "rollout.instances=3", "algorithm.group_size=8"]
    )
    assert config.rollout_buffer.max_inflight_groups == 5  # ceil(10*3*1.2/8) = ceil(4.5)


def test_explicit_values_are_not_derived():
    config = load_config(
        None,
        [
            "rollout_buffer.max_inflight_groups=3",
            "rollout_buffer.max_buffered_groups=20",
            "rollout_buffer.max_dropped_groups_per_step=7",
            "runner.output_dir=/tmp/x",
        ],
    )
    assert config.rollout_buffer.max_inflight_groups == 3
    assert config.rollout_buffer.max_buffered_groups == 20
    assert config.rollout_buffer.max_dropped_groups_per_step == 7
    assert not {"rollout_buffer.max_inflight_groups", "runner.output_dir"} & set(config.derived)
    assert "max_inflight_groups: 3\n" in render(config) + "\n"


def test_buffered_and_dropped_follow_batch_size():
    config = load_config(None, ["data.rollout_batch_size=12"])
    assert config.rollout_buffer.max_buffered_groups == 24
    assert config.rollout_buffer.max_dropped_groups_per_step == 120


def test_instances_from_placement_must_divide_by_tp():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(None, ["cluster.component_placement={rollout: '0-6'}", "rollout.tensor_parallel_size=2"])
    assert parse_gpu_range("0,2,4-5", "k") == [0, 2, 4, 5]
    with pytest.raises(ConfigError, match="not a GPU range"):
        parse_gpu_range("a-b", "cluster.component_placement.rollout")


def test_buffer_smaller_than_batch_is_one_clear_error():
    with pytest.raises(ConfigError) as info:
        load_config(ASYNC, ["data.rollout_batch_size=64", "rollout_buffer.max_buffered_groups=10"])
    message = str(info.value)
    assert "rollout_buffer.max_buffered_groups" in message and "10" in message and "64" in message
    assert "Set rollout_buffer.max_buffered_groups >= 64" in message


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(
        ConfigError, match=r"unknown key rollout\.pause_mod\b.*Did you mean rollout\.pause_mode"
    ):
        load_config(ASYNC, ["rollout.pause_mod=drain"])
    with pytest.raises(ConfigError, match="unknown key nonsense"):
        load_config(None, ["nonsense.key=1"])


def test_unknown_key_in_yaml_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match="algorithm.group_sise.*Did you mean algorithm.group_size"):
        load_config(path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("agentloop.max_turns=abc", "agentloop.max_turns"),
        ("runner.async_mode=3", "runner.async_mode"),
        ("algorithm.ratio_clip_eps=high", "algorithm.ratio_clip_eps"),
        ("data.train_data_paths={a: 1}", "data.train_data_paths"),
        ("rollout=3", "rollout"),
    ],
)
def test_wrong_types_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_async_requires_task_name():
    with pytest.raises(ConfigError, match="agentloop.task_name"):
        load_config(ASYNC, ["agentloop.task_name=null"])
    assert load_config(SYNC, ["agentloop.task_name=null"]).agentloop.task_name is None


def test_async_requires_server_backend():
    with pytest.raises(ConfigError, match="rollout.sglang.backend_type"):
        load_config(ASYNC, ["rollout.sglang.backend_type=engine"])
    load_config(SYNC, ["rollout.sglang.backend_type=engine"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.pause_mode=abort", "rollout.pause_mode"),
        ("rollout.backend=tgi", "rollout.backend"),
        ("rollout.sglang.backend_type=grpc", "rollout.sglang.backend_type"),
        ("algorithm.group_size=0", "algorithm.group_size"),
        ("data.rollout_batch_size=-1", "data.rollout_batch_size"),
        ("tools.search.topk=51", "tools.search.topk"),
        ("tools.search.server_addr=localhost", "tools.search.server_addr"),
        ("agentloop.max_actor_accept_staleness=-1", "agentloop.max_actor_accept_staleness"),
        ("algorithm.dual_clip_c=0.5", "algorithm.dual_clip_c"),
        ("actor.optim.lr_schedule=linear", "actor.optim.lr_schedule"),
        ("rollout_buffer.max_inflight_groups=0", "rollout_buffer.max_inflight_groups"),
        ("rollout_buffer.max_head_offpolicyness=-1", "rollout_buffer.max_head_offpolicyness"),
        ("rollout_buffer.handoff_order=random", "rollout_buffer.handoff_order"),
        ("cluster.component_placement={critic: '0-1'}", "cluster.component_placement"),
        ("actor.optim.betas=[2, 3]", "actor.optim.betas"),  # torch's AdamW would raise at the first step
        ("actor.optim.betas=[-1, 0.5]", "actor.optim.betas"),
        ("actor.optim.betas=[0.9, 1.0]", "actor.optim.betas"),
        ("actor.optim.min_lr_ratio=5", "actor.optim.min_lr_ratio"),
        ("actor.optim.lr=1e30", "actor.optim.lr"),  # trained without error into a useless model
        ("actor.sft.lr=1e38", "actor.sft.lr"),  # overflowed inside the optimizer, a traceback
        ("rollout.engine.kv_cache_gb=.nan", "rollout.engine.kv_cache_gb"),  # NaN <= 0 is False
    ],
)
def test_bad_values_name_key_and_fix(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert key in str(info.value)


def test_staleness_warning(caplog):
    overrides = ["runner.async_mode=true", "agentloop.task_name=t"]  # max_head_offpolicyness is async's
    config = load_config(
        None, ["data.rollout_batch_size=4", "rollout_buffer.max_buffered_groups=12", *overrides]
    )
    config.agentloop.max_actor_accept_staleness = 2  # < ceil(12 / 4) = 3
    with caplog.at_level(logging.WARNING):
        warnings = derive_and_validate(config)
    assert len(warnings) == 1 and "max_actor_accept_staleness=2" in warnings[0]
    assert "max_actor_accept_staleness=2" in caplog.text
    config.agentloop.max_actor_accept_staleness = 3
    assert derive_and_validate(config) == []
    # admission bounded at or below the accept limit: groups no longer wait long enough to be dropped
    config.agentloop.max_actor_accept_staleness = 1
    config.rollout_buffer.max_head_offpolicyness = 1
    assert derive_and_validate(config) == []
    config.rollout_buffer.max_head_offpolicyness = 2
    (warning,) = derive_and_validate(config)
    assert "rollout_buffer.max_head_offpolicyness <= 1" in warning


def test_overrides_parse_yaml_values():
    raw: dict = {}
    apply_override(raw, "data.train_data_paths=[a.jsonl, b.parquet]")
    apply_override(raw, "agentloop.max_actor_accept_staleness=null")
    apply_override(raw, "+runner.name=x")
    assert raw == {
        "data": {"train_data_paths": ["a.jsonl", "b.parquet"]},
        "agentloop": {"max_actor_accept_staleness": None},
        "runner": {"name": "x"},
    }
    with pytest.raises(ConfigError, match="key=value"):
        apply_override(raw, "data.rollout_batch_size")


def test_float_keys_accept_short_exponents():
    assert load_config(None, ["actor.optim.lr=1e-3"]).actor.optim.lr == 1e-3
    with pytest.raises(ConfigError, match="actor.optim.lr"):
        load_config(None, ["actor.optim.lr=fast"])


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_config_show_marks_derived_and_fails_cleanly():
    ok = _tandem("config", "show", str(GLM))
    assert ok.returncode == 0, ok.stderr
    assert "max_inflight_groups: 77  # derived" in ok.stdout
    bad = _tandem(
        "config", "show", str(ASYNC), "data.rollout_batch_size=64", "rollout_buffer.max_buffered_groups=10"
    )
    assert bad.returncode != 0
    assert "rollout_buffer.max_buffered_groups" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_rollout_engine_keys_reach_the_engine_process(tmp_path):
    """rollout.engine.* go whole to `serve-engine` under their own names, and on to `EngineConfig`."""
    from tandemrl.cli import build_parser
    from tandemrl.cluster.server_supervisor import build_server
    from tandemrl.config.engine import EngineConfig, options_from_args
    from tandemrl.runner.services import Services

    (tmp_path / "model").mkdir()
    config = load_config(
        None,
        [
            f"rollout.model.model_path={tmp_path / 'model'}",
            "rollout.device=cpu",
            "rollout.engine.kv_cache_gb=0.5",
            "rollout.engine.max_prefill_tokens=512",
            "rollout.engine.block_size=8",
            "rollout.engine.enable_prefix_caching=false",
            "rollout.engine.enable_cuda_graphs=false",
            "rollout.engine.overlap_steps=true",
            "rollout.startup_timeout_s=12",
            "cluster.use_ray=false",
            "retrieval.launch=false",
        ],
    )
    local, remote = Services(config)._specs()
    assert remote == []  # cluster.use_ray=false: the engine is the runner's own child
    ((name, spec, placement),) = [item for item in local if item[1].kind == "embedded"]
    process = build_server(spec, "127.0.0.1")
    args = build_parser().parse_args(process.server_args())
    engine = EngineConfig(args.model, **options_from_args(args))
    assert (engine.kv_cache_gb, engine.max_prefill_tokens, engine.block_size) == (0.5, 512, 8)
    assert (engine.enable_prefix_caching, engine.enable_cuda_graphs, engine.overlap_steps) == (
        False,
        False,
        True,
    )
    assert process.startup_timeout_s == 12
    defaults = build_parser().parse_args(["serve-engine", "--model", "m", "--port", "1"])
    assert EngineConfig("m", **options_from_args(defaults)) == EngineConfig("m")
    with pytest.raises(ConfigError, match="rollout.engine.max_prefill_tokens=0: must be a finite number > 0"):
        load_config(None, ["rollout.engine.max_prefill_tokens=0"])
    with pytest.raises(
        ConfigError, match="rollout.chunked_prefill_size is now rollout.engine.max_prefill_tokens"
    ):
        load_config(None, ["rollout.chunked_prefill_size=512"])


def test_coldstart_alias_and_the_actor_following_the_rollout(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    config = TandemConfig()
    config.rollout.model.model_path = "coldstart"
    derive_and_validate(config)
    expected = str(tmp_path / "models" / "SmolLM2-135M-Instruct-coldstart")
    assert config.rollout.model.model_path == expected
    assert config.actor.model.model_path == expected  # follows the rollout: one model path
    assert "rollout.model.model_path" in config.derived and "actor.model.model_path" in config.derived


def test_an_actor_path_of_its_own_is_kept_only_on_purpose():
    config = TandemConfig()
    config.rollout.model.model_path, config.actor.model.model_path = "/models/a", "/models/b"
    with pytest.raises(ConfigError, match="set actor.allow_different_model=true"):
        derive_and_validate(config)
    config.actor.allow_different_model = True
    derive_and_validate(config)
    assert (config.rollout.model.model_path, config.actor.model.model_path) == ("/models/a", "/models/b")
    assert "actor.model.model_path" not in config.derived


def test_the_cold_start_fine_tunes_the_base_model_not_its_own_output(tmp_path, monkeypatch):
    from tandemrl.trainer.sft import sft_init_model_path, sft_out_dir

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    config = TandemConfig()
    config.rollout.model.model_path = "coldstart"  # the H200 recipe's configs
    derive_and_validate(config)
    assert sft_init_model_path(config) is None  # the embedded SmolLM2
    assert sft_out_dir(config) == tmp_path / "models" / "SmolLM2-135M-Instruct-coldstart"
    config.actor.model.model_path = "/models/qwen"
    assert sft_init_model_path(config) == "/models/qwen"
    assert sft_out_dir(config) == Path(config.runner.output_dir) / "sft_model"
    config.actor.sft.init_model_path, config.actor.sft.out_dir = "/models/llama", str(tmp_path / "out")
    assert (sft_init_model_path(config), sft_out_dir(config)) == ("/models/llama", tmp_path / "out")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["runner.async_mode=false"], 0),  # sync: nothing in flight at an update, exact K/V
        (["runner.async_mode=true", "agentloop.task_name=searchr1"], 1),  # async: previous K/V serves
        (  # async on the sync schedule: nothing in flight at an update either
            [
                "runner.async_mode=true",
                "agentloop.task_name=searchr1",
                "rollout_buffer.max_head_offpolicyness=0",
            ],
            0,
        ),
        (["runner.async_mode=false", "rollout.engine.prefix_cache_max_age=3"], 3),  # set: kept
    ],
)
def test_prefix_cache_age_is_derived_by_runner(overrides, expected):
    config = load_config(None, overrides)
    assert config.rollout.engine.prefix_cache_max_age == expected
    is_set = any(o.startswith("rollout.engine.prefix_cache_max_age") for o in overrides)
    assert ("rollout.engine.prefix_cache_max_age" in config.derived) == (not is_set)


def test_prefix_cache_age_out_of_range_names_the_key():
    with pytest.raises(ConfigError, match="prefix_cache_max_age=9"):
        load_config(None, ["rollout.engine.prefix_cache_max_age=9"])


def test_cpu_offload_is_for_a_gpu_actor():
    """actor.cpu_offload on a CPU actor is refused at load (named), and by the actor itself where `auto`
    resolved to the CPU."""
    import torch

    from tandemrl.trainer.policy import shard_policy

    with pytest.raises(ConfigError, match="actor.cpu_offload"):
        load_config(None, ["actor.device=cpu", "actor.cpu_offload=true"])
    assert load_config(None, ["actor.device=cuda", "actor.cpu_offload=true"]).actor.cpu_offload is True
    with pytest.raises(ValueError, match="actor.cpu_offload=true with the actor on cpu"):
        shard_policy(torch.nn.Module(), torch.device("cpu"), torch.float32, cpu_offload=True)


@pytest.mark.parametrize(
    "override, by_key",
    [
        ("runner=", "runner.name=x"),
        ("runner={name: x}", "runner.name=x"),
        ("actor.optim={lr: 0.1}", "actor.optim.lr=0.1"),
        ("rollout.engine=", "rollout.engine.block_size=16"),
    ],
)
def test_a_section_is_overridden_key_by_key(override, by_key):
    """Replacing a whole section would silently put the file's other keys of it back to their defaults."""
    with pytest.raises(ConfigError, match="is a section"):
        load_config(ASYNC, [override])
    config = load_config(ASYNC, [by_key])
    assert config.runner.async_mode is load_config(ASYNC).runner.async_mode is True  # the file's key kept


def test_mapping_valued_keys_and_named_entries_still_take_a_mapping():
    config = load_config(ASYNC, ["cluster.mps_sm_percent={rollout: 30}", "cluster.mps=true"])
    assert config.cluster.mps_sm_percent == {"rollout": 30}


def test_a_repeated_override_takes_its_last_value():
    """README, Configuring: benchmark scripts append a run's own override to a list of shared ones."""
    config = load_config(ASYNC, ["rollout.pause_mode=in_place", "rollout.pause_mode=retract"])
    assert config.rollout.pause_mode == "retract"


@pytest.mark.parametrize("backend, seconds", [("embedded", 300.0), ("vllm", 900.0), ("sglang", 900.0)])
def test_the_start_up_timeout_follows_the_backend_unless_set(backend, seconds):
    """A first vLLM start of SmolLM2-135M on a fresh H100 took 247 s of the 300 s every backend had."""
    config = load_config(None, [f"rollout.backend={backend}", "rollout.server_addrs=[127.0.0.1:30000]"])
    assert config.rollout.startup_timeout_s == seconds
    assert (
        config.derived["rollout.startup_timeout_s"]
        == f"{seconds:g} (the default for rollout.backend={backend})"
    )
    chosen = load_config(
        None,
        [
            f"rollout.backend={backend}",
            "rollout.server_addrs=[127.0.0.1:30000]",
            "rollout.startup_timeout_s=45",
        ],
    )
    assert chosen.rollout.startup_timeout_s == 45 and "rollout.startup_timeout_s" not in chosen.derived
