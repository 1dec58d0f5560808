"""Absurd and malformed configuration values, typed as a user types them: each is refused in one line that
names the key (never a traceback, a hang, a silent exit or a silently ignored value)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.cli import main
from tandemrl.config.derive import check_context_len, parse_gpu_range
from tandemrl.config.engine import model_context_limit
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError

SYNC = str(Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_sync.yaml")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # a run directory or a `runs/` made by mistake lands here


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "override, key",
    [
        # a huge range built a list of 10**12 ids: MemoryError (a traceback) in `config show` and the dry run
        ("cluster.component_placement={rollout: 0-1000000000000}", "cluster.component_placement.rollout"),
        ("cluster.component_placement={actor: 0-1000000000000}", "cluster.component_placement.actor"),
        # a descending range was no GPU at all: rollout.instances derived 0, the dry run's max() raised
        ("cluster.component_placement={rollout: 5-0}", "cluster.component_placement.rollout"),
        ("cluster.component_placement={rollout: 0--3}", "cluster.component_placement.rollout"),
        # int() reads these, so they were taken as GPU 3, 10 and 1
        ("cluster.component_placement={actor: '٣'}", "cluster.component_placement.actor"),
        ("cluster.component_placement={actor: '1_0'}", "cluster.component_placement.actor"),
        ("cluster.component_placement={actor: '+1'}", "cluster.component_placement.actor"),
        # the same GPU twice: two ranks (or engines) of one component on one GPU
        ("cluster.component_placement={rollout: '0,0'}", "cluster.component_placement.rollout"),
        # the actor's range was only read by the plan, so `config show` passed it
        ("cluster.component_placement={actor: '-1'}", "cluster.component_placement.actor"),
        ("cluster.component_placement={actor: ''}", "cluster.component_placement.actor"),
    ],
)
def test_gpu_ranges_that_are_no_gpus_are_refused_by_config_show(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(SYNC, [override])


def test_gpu_range_parser_keeps_what_it_read():
    assert parse_gpu_range(" 0 - 3 ,5", "k") == [0, 1, 2, 3, 5]
    with pytest.raises(ConfigError, match="GPU 1 more than once"):
        parse_gpu_range("0-2,1", "k")


@pytest.mark.parametrize(
    "overrides",
    [
        # a dry run of these built 10**18 process placements and never ended
        ["actor.num_ranks=1000000000000000000"],
        ["rollout.instances=1000000000000000000"],
    ],
)
def test_dry_run_of_huge_process_counts_ends_with_an_error(capsys, overrides):
    code, out = run_cli(capsys, "train", SYNC, *overrides, "--dry-run")
    key = overrides[0].split("=")[0]
    assert code == 2 and f"{key}=1000000000000000000" in out and "Traceback" not in out


def test_actor_ranks_beyond_the_node_are_refused():
    """Without a placement the ranks run on node 0, one per GPU: 16 ranks on an 8-GPU node were planned on
    GPUs 0-15 of node 0."""
    overrides = ["actor.device=cuda", "actor.num_ranks=16", "cluster.num_gpus_per_node=8"]
    with pytest.raises(ConfigError, match="actor.num_ranks=16 .*cluster.num_gpus_per_node=8"):
        load_config(SYNC, overrides)
    load_config(SYNC, ["actor.device=cuda", "actor.num_ranks=8", "cluster.num_gpus_per_node=8"])


@pytest.mark.parametrize(
    "overrides, key",
    [
        # the plan read the first key naming the actor and ignored `actor: 1`
        (["cluster.component_placement={'actor,rollout': 0, actor: 1}"], "cluster.component_placement"),
        # refused only by the dry run's plan; `config show` passed it
        (["cluster.retrieval_node=5"], "cluster.retrieval_node=5 but cluster.num_nodes=1"),
        # without Ray the address is never read
        (["cluster.use_ray=false", "cluster.ray_address=auto"], "cluster.ray_address"),
        # NCCL and CUDA IPC with a CPU side failed at the first weight push
        (["rollout.weight_sync=nccl"], "rollout.weight_sync=nccl"),
        (["rollout.weight_sync=cuda_ipc"], "rollout.weight_sync=cuda_ipc"),
        # one engine listed twice got every weight update twice
        (['rollout.server_addrs=["h:30000", "h:30000"]'], "rollout.server_addrs"),
    ],
)
def test_contradictions_that_were_silently_accepted(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(SYNC, overrides)


@pytest.mark.parametrize("addr", [":", " :", "h:99999", "abc:def", "h:0", "h:٣٠", "http://:80"])
def test_search_server_addresses_that_no_search_can_reach(addr):
    with pytest.raises(ConfigError, match="tools.search.server_addr"):
        load_config(SYNC, [f"tools.search.server_addr={addr}"])


@pytest.mark.parametrize("addr", ["127.0.0.1:8000", "http://h:80", "https://h:443/retrieve", "[::1]:8000"])
def test_search_server_addresses_that_work_still_pass(addr):
    assert load_config(SYNC, [f"tools.search.server_addr={addr}"]).tools.search.server_addr == addr


def test_engine_port_of_non_ascii_digits_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.server_addrs\[0\]"):
        load_config(SYNC, ['rollout.server_addrs=["h:٣٠"]'])


@pytest.mark.parametrize(
    "key",
    [
        "runner.name",
        "runner.output_dir",
        "retrieval.index_dir",
        "rollout.sglang.python",
        "agentloop.task_name",
    ],
)
def test_a_nul_character_in_a_string_is_refused(key):
    """`tandem train CONFIG 'runner.output_dir="a\\0b"'` passed the config and ended in a ValueError
    traceback (embedded null byte) when the run made its directory."""
    with pytest.raises(ConfigError, match=f"{key}=.*NUL character"):
        load_config(SYNC, [f'{key}="a\\0b"'])


def test_train_with_a_nul_in_the_output_dir_is_one_line(capsys):
    code, out = run_cli(capsys, "train", SYNC, 'runner.output_dir="a\\0b"')
    assert code == 2 and "runner.output_dir=" in out and "Traceback" not in out


@pytest.mark.parametrize("function", ["sys:exit", "builtins:exit"])
def test_a_reward_that_exits_is_refused_not_a_silent_success(capsys, function):
    """The dry call's SystemExit ended `tandem config show` with nothing printed and exit status 0."""
    code, out = run_cli(capsys, "config", "show", SYNC, f"reward.function={function}")
    assert code == 2 and f"reward.function='{function}'" in out and "SystemExit" in out


def test_a_bad_actor_model_path_is_named_by_the_key_the_user_set(capsys, tmp_path):
    """The rollout follows the actor's path, and the error named rollout.model.model_path, a key the user
    never typed."""
    code, out = run_cli(capsys, "config", "show", SYNC, "actor.model.model_path=/no/such/model")
    assert code == 2 and "actor.model.model_path='/no/such/model'" in out
    assert "rollout.model.model_path" not in out
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    with pytest.raises(ConfigError, match="^actor.model.model_path="):
        load_config(SYNC, [f"actor.model.model_path={a_file}"])


def test_spec_ngram_error_names_both_keys_in_full():
    with pytest.raises(ConfigError, match="rollout.engine.spec_ngram_max=0"):
        load_config(SYNC, ["rollout.engine.spec_ngram_max=0"])


def test_an_empty_config_path_is_named_as_typed(capsys):
    """Path('') is '.', and the message said "config file '.' is a directory"."""
    code, out = run_cli(capsys, "config", "show", "")
    assert code == 2 and "config file '' is an empty path" in out


@pytest.mark.parametrize(
    "key",
    [
        "runner.engine_health_interval_s",
        "rollout.startup_timeout_s",
        "rollout.weight_update_timeout_s",
        "tools.search.timeout_s",
    ],
)
def test_a_timeout_past_what_a_wait_takes_is_refused(key):
    """1e18 seconds passed the checks and reached `Event.wait` / `time.sleep` as an OverflowError."""
    with pytest.raises(ConfigError, match=rf"^{key}=1e\+18: must be a number of seconds > 0 and at most"):
        load_config(SYNC, [f"{key}=1e18"])
    load_config(SYNC, [f"{key}=86400"])  # a day is still a timeout


@pytest.mark.parametrize("text", ["0123", "1:30", "1.10", "007", "1e3", "0x1F"])
def test_a_text_key_keeps_the_number_like_text_as_typed(tmp_path, text):
    """YAML 1.1 reads 0123 as octal 83, 1:30 as base-60 90 and 1.10 as 1.1: a name was silently another."""
    config = tmp_path / "config.yaml"
    config.write_text(f"runner:\n  name: {text}\n  max_steps: 0x10\n")
    from_file = load_config(config)
    assert from_file.runner.name == text
    assert from_file.runner.max_steps == 16 and type(from_file.runner.max_steps) is int
    assert load_config(SYNC, [f"runner.name={text}"]).runner.name == text


@pytest.mark.parametrize(
    "override, key, fine",
    [
        # 2 x 10**8 trajectories: the run died of the out-of-memory killer before step 1 (rc 137)
        (
            "algorithm.group_size=100000000",
            "data.rollout_batch_size=2 x algorithm.group_size=100000000",
            "16",
        ),
        # the engine answered every request 400 once the services had started
        ("agentloop.top_k=1000000000000", "agentloop.top_k=1000000000000", "50"),
        # two blocks of 10**8 tokens: a 300 GB allocation, a RuntimeError in the engine at start-up
        ("rollout.engine.block_size=100000000", "rollout.engine.block_size=100000000", "32"),
        # a CPU run took it; on a GPU the embedded engine would capture a CUDA graph for every 16 requests
        ("rollout.max_running_requests=1000000000", "rollout.max_running_requests=1000000000", "1024"),
    ],
)
def test_sizes_that_would_exhaust_memory_are_refused_by_config_show(capsys, override, key, fine):
    code, out = run_cli(capsys, "config", "show", SYNC, override)
    assert code == 2 and key in out and "Traceback" not in out
    name = override.split("=")[0]
    load_config(SYNC, [f"{name}={fine}"])  # a real size still passes


def write_model_config(model_dir: Path, **fields) -> Path:
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return model_dir


@pytest.mark.parametrize(
    "fields, limit",
    [
        ({"max_position_embeddings": 8192}, 8192),
        ({"text_config": {"max_position_embeddings": 4096}}, 4096),  # a multimodal config nests it
        # YaRN stretches the original positions by its factor (Qwen2.5's long-context recipe)
        (
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            },
            131072,
        ),
        ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 4096),
        # llama3's config already names the stretched length
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        ({}, None),
    ],
)
def test_the_context_a_model_config_allows(fields, limit):
    assert model_context_limit({"model_type": "llama", **fields}) == limit


def test_a_context_past_the_model_is_refused_before_any_service(capsys, tmp_path):
    """10**12 tokens sized the engine's tables and the run died of the out-of-memory killer at start-up."""
    model = write_model_config(tmp_path / "model", max_position_embeddings=2048)
    overrides = [f"rollout.model.model_path={model}", "rollout.max_context_len=1000000000000"]
    with pytest.raises(
        ConfigError, match=r"^rollout.max_context_len=1,000,000,000,000 is longer than the 2,048"
    ):
        check_context_len(load_config(SYNC, overrides), model)
    check_context_len(load_config(SYNC, [overrides[0], "rollout.max_context_len=2048"]), model)
