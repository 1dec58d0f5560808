"""What the user's path promises (issue 42, items 8 and 12-15): keys that would mean nothing are refused
at `tandem config show`; `config show --check` runs every check `tandem train` makes before it starts a
service, and `train` makes them before it starts one; the dry run plans only what the machine will do;
the docs say what each make target runs; the seed's (RLinf's) habits work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandemrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples/searchr1/config"
ASYNC, SYNC = CONFIGS / "embedded_cpu_async.yaml", CONFIGS / "embedded_cpu_sync.yaml"
GLM = CONFIGS / "train_glm4.7_flash_2node_async.yaml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


# ---- item 8: keys accepted where they mean nothing --------------------------------------------------


@pytest.mark.parametrize(
    ("config", "overrides", "needles"),
    [
        (
            SYNC,
            ["cluster.colocated_policy=time_share"],
            ["cluster.colocated_policy=time_share", "async_mode"],
        ),
        (SYNC, ["rollout_buffer.max_head_offpolicyness=2"], ["rollout_buffer.max_head_offpolicyness=2"]),
        (
            SYNC,
            ["agentloop.max_actor_accept_staleness=1"],
            ["agentloop.max_actor_accept_staleness=1", "async_mode=false"],
        ),
        (ASYNC, ["runner.max_steps=4", "runner.profile_steps=[2,9]"], ["runner.profile_steps", "[9]"]),
        (ASYNC, ["cluster.mps=true"], ["cluster.mps=true", "rollout.device=cpu"]),
    ],
)
def test_config_show_refuses_keys_that_would_mean_nothing(capsys, config, overrides, needles):
    code, _, err = _run(capsys, "config", "show", config, *overrides)
    _refused(code, err, *needles)


def test_mps_without_nvidia_tools_is_refused_at_config_show(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without the NVIDIA driver's utilities
    overrides = ["cluster.mps=true", "actor.device=cuda", "rollout.device=cuda"]
    code, _, err = _run(capsys, "config", "show", ASYNC, *overrides)
    _refused(code, err, "cluster.mps=true", "nvidia-cuda-mps-control")


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_at_config_show(capsys, monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/tmp/" + "d" * 60)  # Ray would fail on it only after it began starting
    code, _, err = _run(capsys, "config", "show", ASYNC, "cluster.use_ray=true")
    _refused(code, err, "TMPDIR='/tmp/ddd", "RAY_TMPDIR=/tmp")
    code, _, err = _run(capsys, "config", "show", ASYNC, "cluster.use_ray=false")  # no Ray: nothing to bind
    assert code == 0, err
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")  # Ray's own key comes first
    code, _, err = _run(capsys, "config", "show", ASYNC, "cluster.use_ray=true")
    assert code == 0, err


def test_the_temp_dir_check_draws_rays_own_line():
    """The longest TMPDIR the check lets through gives Ray a socket path its own validator accepts, and
    one byte more is refused by both."""
    from ray._private.utils import validate_socket_filepath

    from tandemrl.cluster.ray_nodes import _SESSION_SOCKET, local_ray_socket_problem

    fits = "/" + "t" * (107 - len(f"/ray/{_SESSION_SOCKET}") - 1)
    assert local_ray_socket_problem({"TMPDIR": fits}) is None
    validate_socket_filepath(f"{fits}/ray/{_SESSION_SOCKET}")
    problem = local_ray_socket_problem({"TMPDIR": fits + "t", "RAY_TMPDIR": ""})
    assert problem and f"at most {len(fits)} characters" in problem, problem
    with pytest.raises(OSError, match="AF_UNIX path length"):
        validate_socket_filepath(f"{fits}t/ray/{_SESSION_SOCKET}")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["runner.max_steps=4", "runner.val_interval=10"],
            "runner.val_interval=10 is past runner.max_steps=4",
        ),
        (["cluster.mps=true", "cluster.mps_sm_percent.actor=60"], "cluster.mps_sm_percent={'actor': 60}"),
        (["retrieval.launch=false", "retrieval.index_dir=/data/idx"], "retrieval.index_dir='/data/idx'"),
    ],
)
def test_keys_nothing_reads_are_warned_about_in_one_line(overrides, needle):
    from tandemrl.config.derive import derive_and_validate
    from tandemrl.config.loader import load_config

    config = load_config(SYNC, overrides)
    (warning,) = [w for w in derive_and_validate(config) if needle in w]
    assert "\n" not in warning


# ---- item 12: config show --check runs what train checks before it starts a service --------------------


def _prepared(tmp_path: Path) -> list[str]:
    """Overrides naming a model directory, an index directory and a small question file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")  # what makes a directory an index
    questions = tmp_path / "train.jsonl"
    questions.write_text('{"id": 1, "question": "a?", "golden_answers": ["b"]}\n')
    return [
        f"rollout.model.model_path={tmp_path / 'model'}",
        f"retrieval.index_dir={tmp_path / 'index'}",
        f"data.train_data_paths=[{questions}]",
    ]


def test_config_show_check_runs_trains_start_up_checks(capsys, tmp_path):
    good = _prepared(tmp_path)
    code, out, err = _run(capsys, "config", "show", "--check", ASYNC, *good)
    assert code == 0 and "every check `tandem train` makes before it starts a service passed" in err, err
    assert "train_data_paths" in out
    code, _, err = _run(
        capsys, "config", "show", "--check", ASYNC, *good, f"retrieval.index_dir={tmp_path}/no"
    )
    _refused(code, err, "retrieval.index_dir", "does not exist")
    code, _, err = _run(capsys, "config", "show", "--check", ASYNC, *good, f"retrieval.index_dir={tmp_path}")
    _refused(code, err, "retrieval.index_dir", "is not a retrieval index", "index.json")
    code, _, err = _run(
        capsys, "config", "show", "--check", ASYNC, *good, "data.train_data_paths=[/no/q.jsonl]"
    )
    _refused(code, err, "data.train_data_paths", "/no/q.jsonl", "does not exist")
    code, _, err = _run(capsys, "config", "show", "--check", GLM)
    _refused(code, err, "/path/to/GLM-4.7-Flash", "placeholder")


def test_train_refuses_before_it_starts_a_service(tmp_path, monkeypatch, capsys):
    """The same checks inside `tandem train`, before anything is launched (a launch fails the test)."""
    from tandemrl.runner import services

    def no_launch(self):
        raise AssertionError("a service was started before the start-up checks")

    monkeypatch.setattr(services.Services, "launch", no_launch)
    monkeypatch.setattr("tandemrl.cluster.reaper.start_reaper", lambda: None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a?", "golden_answers": {"b": 1}}\n')
    overrides = [
        *_prepared(tmp_path),
        f"data.train_data_paths=[{bad}]",
        f"runner.output_dir={tmp_path / 'r'}",
    ]
    code, _, err = _run(capsys, "train", ASYNC, *overrides)
    _refused(code, err, "data.train_data_paths", str(bad), "line 1", "golden_answers")


# ---- item 13: the dry run plans what the machine will do --------------------------------------------


def test_dry_run_says_ray_chooses_the_gpus_and_shows_the_real_sglang_command(capsys):
    overrides = ["rollout.model.model_path=/models/glm", "rollout.sglang.python=/opt/sglang/bin/python"]
    code, out, err = _run(capsys, "train", GLM, "--dry-run", *overrides)
    assert code == 0, err
    assert "rollout SGLang server 0: node 1, 4 GPUs (Ray chooses which)" in out
    assert "GPUs 0-3" not in out
    command = next(line for line in out.splitlines() if line.startswith("rollout engine 0 command:"))
    assert command.split(": ", 1)[1].startswith("/opt/sglang/bin/python -m sglang.launch_server")
    assert "--config <args.yaml with the run's API key" in command
    code, out, _ = _run(capsys, "train", GLM, "--dry-run", "rollout.model.model_path=/models/glm")
    assert f"command: {sys.executable} -m sglang.launch_server" in out


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            [
                "cluster.use_ray=false",
                "cluster.component_placement={actor: '0', rollout: '1'}",
                "actor.device=cuda",
                "rollout.device=cuda",
            ],
            ["cluster.use_ray=false", "GPU 1", "cluster.use_ray=true"],
        ),
        (["rollout.tensor_parallel_size=2"], ["rollout.tensor_parallel_size=2", "backend=embedded"]),
    ],
)
def test_dry_run_refuses_what_the_machine_would_not_do(capsys, overrides, needles):
    code, out, err = _run(capsys, "train", ASYNC, "--dry-run", *overrides)
    _refused(code, err, *needles)
    assert "nothing started" not in out


# ---- item 14: what each make target runs ------------------------------------------------------------


def test_readme_says_what_each_make_target_runs():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "the whole test suite" not in readme
    targets = re.findall(r"^(test[\w-]*|lint):", makefile, flags=re.M)
    assert {"test", "test-slow", "test-vllm", "test-gpu"} <= set(targets)
    for target in targets:
        assert re.search(rf"^\| `make {target}` \| .+ \|$", readme, flags=re.M), f"make {target} undescribed"
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    marker = re.search(r"-m '([^']+)'", addopts).group(1)
    row = re.search(r"^\| `make test` \| (.+) \|$", readme, flags=re.M).group(1)
    assert f"-m '{marker}'" in row  # the default suite's marker expression, as pyproject has it
    for marker_name in re.findall(r"not (\w+)", marker):  # each excluded marker has a target that runs it
        assert re.search(
            rf"^\| `make test-{marker_name}` \| only the tests marked `{marker_name}`", readme, re.M
        )


# ---- item 15: the seed's users' habits ----------------------------------------------------------------


def test_rlinf_node_rank_is_an_alias_of_tandem_node_rank(monkeypatch):
    from tandemrl.cluster import ray_nodes

    monkeypatch.delenv("TANDEM_NODE_RANK", raising=False)
    monkeypatch.setenv("RLINF_NODE_RANK", "1")
    assert ray_nodes._node_rank_from_env() == "1"
    monkeypatch.setenv("TANDEM_NODE_RANK", "1")
    assert ray_nodes._node_rank_from_env() == "1"
    monkeypatch.setenv("TANDEM_NODE_RANK", "2")  # two different ranks for one node: refused by the driver
    assert ray_nodes._node_rank_from_env() == "2 vs 1"


def test_the_seeds_script_path_runs_the_same_script():
    link = ROOT / "examples/agent/searchr1/run_train.sh"
    assert link.resolve() == (ROOT / "examples/searchr1/run_train.sh").resolve()
    result = subprocess.run(["bash", str(link)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "embedded_cpu_async" in result.stderr  # lists the configs it finds


def test_readme_two_node_steps_start_the_retrieval_server_the_glm_config_names():
    config = yaml.safe_load(GLM.read_text())
    assert config["retrieval"]["launch"] is False
    port = config["tools"]["search"]["server_addr"].rsplit(":", 1)[1]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Placement and several nodes") :]
    section = section[: section.index("\n## ", 1)]
    assert re.search(rf"tandem serve-retrieval --index \S+ --port {port}", section)
    assert "RLINF_NODE_RANK" in section and "examples/agent/searchr1/run_train.sh" in section


def test_config_show_docstring_no_longer_promises_more_than_it_checks():
    from tandemrl.commands import show

    assert "a config that shows is one that starts" not in show.__doc__
    assert "--check" in show.__doc__


def test_external_engines_that_nothing_answers_at_are_refused_before_a_service(capsys, tmp_path):
    """An address with no server behind it failed the run with aiohttp's traceback after Ray and the actor
    had started; `--check` and `train` now refuse it first, naming the entry."""
    import socket

    good = _prepared(tmp_path)
    with socket.socket() as listener:  # a port that accepts connections: the check passes
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        external = ["rollout.backend=sglang", f"rollout.server_addrs=[127.0.0.1:{port}]"]
        code, _, err = _run(capsys, "config", "show", "--check", ASYNC, *good, *external)
        assert code == 0, err
    # closed now: nothing accepts a connection at that port
    code, _, err = _run(capsys, "config", "show", "--check", ASYNC, *good, *external)
    _refused(code, err, "rollout.server_addrs[0]", f"127.0.0.1:{port}", "nothing accepts a connection")
    code, _, err = _run(
        capsys, "config", "show", ASYNC, "rollout.backend=sglang", "rollout.server_addrs=[h:99999]"
    )
    _refused(code, err, "rollout.server_addrs[0]", "port from 1 to 65535")


def test_config_show_check_refuses_an_output_dir_that_cannot_be_a_directory(capsys, tmp_path):
    """`train` refuses these when it takes the directory; `--check` now says so first, creating nothing."""
    good = _prepared(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run\n")
    for output_dir in (a_file, a_file / "run"):
        code, _, err = _run(
            capsys, "config", "show", "--check", ASYNC, *good, f"runner.output_dir={output_dir}"
        )
        _refused(code, err, f"runner.output_dir={str(output_dir)!r}", f"{str(a_file)!r} is a file")
    assert a_file.read_text() == "not a run\n"
    code, _, err = _run(
        capsys, "config", "show", "--check", ASYNC, *good, f"runner.output_dir={tmp_path}/new/run"
    )
    assert code == 0 and not (tmp_path / "new").exists(), err
