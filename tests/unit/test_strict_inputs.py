"""Bad configuration and bad weights are refused whole, at the first moment they can be seen: each
config case exits 2 with one paragraph at load time; a refused weight load changes nothing
(docs/RELIABILITY.md lists the promises these tests guard)."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
import torch

from tandemrl.cli import build_parser, main
from tests.unit.test_config import ASYNC


def _tandem_config_show(tmp_path, capsys, path, *overrides) -> tuple[int, str]:
    code = main(["config", "show", str(path), *overrides])
    return code, capsys.readouterr().err


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _link_loop(tmp_path):
    link = tmp_path / "loop.yaml"
    link.symlink_to(tmp_path / "loop.yaml")
    return link


def _alias_bomb_flow(levels: int) -> str:
    """[&a [1 x10], &b [*a x10], ...]: each level repeats the last ten times (10**levels values)."""
    names = "abcdefghij"
    lists = ["&a [" + ",".join(["1"] * 10) + "]"]
    for i in range(1, levels):
        lists.append(f"&{names[i]} [" + ",".join([f"*{names[i - 1]}"] * 10) + "]")
    return "[" + ", ".join(lists) + "]"


def _alias_bomb(levels: int) -> bytes:
    return f"agentloop:\n  task_name: {_alias_bomb_flow(levels)}\n".encode()


CONFIG_CASES = {
    "binary file": (lambda t: _write(t, "model.bin", bytes(range(256)) * 4), [], "not UTF-8 text"),
    "a directory": (lambda t: t, [], "is a directory"),
    "a device": (lambda t: "/dev/null", [], "not a regular file"),
    "duplicate key": (
        lambda t: _write(t, "dup.yaml", b"runner:\n  max_steps: 3\n  max_steps: 5\n"),
        [],
        "appears twice",
    ),
    "context shorter than the response": (
        lambda t: ASYNC,
        ["rollout.max_context_len=16"],
        "rollout.max_context_len=16",
    ),
    "turn longer than the response": (
        lambda t: ASYNC,
        ["agentloop.max_new_tokens_per_turn=2000", "rollout.max_context_len=4096"],
        "agentloop.max_new_tokens_per_turn=2000",
    ),
    "in-flight above buffered": (
        lambda t: ASYNC,
        ["rollout_buffer.max_inflight_groups=9"],
        "rollout_buffer.max_inflight_groups=9",
    ),
    "minibatches above trajectories": (
        lambda t: ASYNC,
        ["algorithm.n_minibatches=9"],
        "algorithm.n_minibatches=9",
    ),
    "GRPO with groups of one": (lambda t: ASYNC, ["algorithm.group_size=1"], "algorithm.group_size=1"),
    "infinite lr": (lambda t: ASYNC, ["actor.optim.lr=.inf"], "actor.optim.lr"),
    "nan lr": (lambda t: ASYNC, ["actor.optim.lr=.nan"], "actor.optim.lr"),
    "search timeout 0": (lambda t: ASYNC, ["tools.search.timeout_s=0"], "tools.search.timeout_s=0"),
    "missing resume_from": (lambda t: ASYNC, ["runner.resume_from=/nonexistent/ckpt"], "runner.resume_from"),
    "model dir with a broken config.json": (
        lambda t: ASYNC,
        ["rollout.model.model_path={broken}"],
        "config.json is not valid JSON",
    ),
    "top_k 0": (lambda t: ASYNC, ["agentloop.top_k=0"], "agentloop.top_k=0"),
    # round two (docs/RELIABILITY.md rows 15 and 17): bounded input, and what `train` refused at once
    "max_turns 0": (lambda t: ASYNC, ["agentloop.max_turns=0"], "agentloop.max_turns=0: must be >= 1"),
    # launched vLLM is accepted where its interpreter imports vllm (tests/unit/test_engine_launch_cli.py);
    # the suite's interpreter has none, and the refusal names it and the keys that change it
    "vllm where its interpreter cannot import it": (
        lambda t: ASYNC,
        ["rollout.backend=vllm"],
        "`import vllm` there failed: ModuleNotFoundError: No module named 'vllm'. Point rollout.vllm.python",
    ),
    "a model path that does not exist": (
        lambda t: ASYNC,
        ["rollout.model.model_path={missing}"],
        "rollout.model.model_path='{missing}' is not a directory",
    ),
    "a symlink loop": (lambda t: _link_loop(t), [], "a link loop"),
    "an alias bomb": (
        lambda t: _write(t, "bomb.yaml", _alias_bomb(6)),
        [],
        "expands to more than 100000 values",
    ),
    "100000 levels of nesting": (
        lambda t: _write(t, "deep.yaml", b"agentloop: " + b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        [],
        "nests deeper than 32 levels",
    ),
    "a 2 MiB file": (
        lambda t: _write(t, "big.yaml", b"runner:\n  max_steps: 3\n" + b"# padding\n" * 200_000),
        [],
        "larger than 1024 KiB",
    ),
    "an integer of 5000 digits": (
        lambda t: _write(t, "long.yaml", b"runner:\n  max_steps: " + b"7" * 5000 + b"\n"),
        [],
        "line 2 holds an integer of 5000 digits",
    ),
    "an alias bomb in an override": (
        lambda t: ASYNC,
        ["agentloop.task_name=" + _alias_bomb_flow(6)],
        "expands",
    ),
    "100000 brackets in an override": (
        lambda t: ASYNC,
        ["agentloop.task_name=" + "[" * 30_000 + "]" * 30_000],
        "deeper than 32",
    ),
    "an integer beyond 64 bits": (
        lambda t: ASYNC,
        ["runner.max_steps=1" + "0" * 30],
        "at most 9223372036854775807",
    ),
    "a long list where a string goes": (
        lambda t: ASYNC,
        ["agentloop.task_name=[" + ",".join(["1"] * 5000) + "]"],
        "agentloop.task_name=[1, 1, 1, 1, ...] (5000 items): wrong type",
    ),
    "negative warm-up": (lambda t: ASYNC, ["actor.optim.warmup_steps=-1"], "actor.optim.warmup_steps=-1"),
    "text that is not UTF-8 on the command line": (
        lambda t: ASYNC,
        ["runner.name=caf\udcff"],
        "not valid UTF-8",
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_exits_2_with_one_paragraph_at_load(case, tmp_path, capsys):
    make_path, overrides, expected = CONFIG_CASES[case]
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama",')
    missing = tmp_path / "no-such-model"
    overrides = [o.format(broken=broken, missing=missing) for o in overrides]
    code, err = _tandem_config_show(tmp_path, capsys, make_path(tmp_path), *overrides)
    assert code == 2 and expected.format(missing=missing) in err, err[:2000]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[:2000]
    assert len(err) < 1500, f"{len(err)} characters: the value was not summarized"


def test_config_show_wording_for_missing_paths(tmp_path, capsys):
    code, err = _tandem_config_show(tmp_path, capsys, tmp_path / "nope.yaml")
    assert code == 2 and "does not exist" in err
    code, err = _tandem_config_show(tmp_path, capsys, "/tmp")
    assert code == 2 and "does not exist" not in err and "directory" in err


def test_a_binary_config_gives_no_traceback_in_a_real_process(tmp_path):
    path = _write(tmp_path, "weights.bin", bytes(range(256)) * 64)
    result = subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", "config", "show", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and "not UTF-8" in result.stderr


def test_config_show_hides_api_keys(capsys):
    assert main(["config", "show", str(ASYNC), "rollout.api_key=s3cret-key"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-key" not in out and "api_key: <set>" in out


def test_help_is_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.rstrip().endswith(".") and "function in" not in description


# ---- weights: one loader for every update route (distributed, CUDA IPC, disk) ---------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tandemrl.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(str(tiny_llama_dir), max_context_len=64, max_running_requests=2))


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize(
    "bad, reason",
    [
        (("model.bogus.weight", torch.zeros(4)), "not a parameter"),
        (("model.norm.weight", torch.zeros(3)), "has shape"),
        (("model.norm.weight", torch.full((64,), float("inf"))), "NaN or infinite"),
        (("model.norm.weight", torch.ones(64, dtype=torch.int64)), "not floating point"),
    ],
)
def test_a_refused_load_changes_no_weight_and_no_version(engine, bad, reason):
    before, version = _weights(engine), engine.weight_version
    embed = before["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match=reason):
        engine.load_weights([("model.embed_tokens.weight", torch.zeros_like(embed)), bad], version + 1)
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.weight_version == version


def test_weight_versions_only_move_forward(engine):
    norm = _weights(engine)["model.norm.weight"]
    start = engine.weight_version
    assert engine.load_weights([("model.norm.weight", norm)], start + 2) == start + 2
    assert (
        engine.load_weights([("model.norm.weight", norm)], start + 2) == start + 2
    )  # next bucket, same push
    for stale in (start + 1, -5):
        with pytest.raises(ValueError, match="not larger than the current weight_version"):
            engine.load_weights([("model.norm.weight", norm)], stale)
    assert engine.load_weights([("model.norm.weight", norm)]) == start + 3  # a bare call bumps
    with pytest.raises(ValueError, match="not larger"):  # a bumped version is not a push to repeat
        engine.load_weights([("model.norm.weight", norm)], start + 3)


def test_ray_token_is_made_private(tmp_path, monkeypatch):
    from tandemrl.cluster.ray_security import harden_local_ray, local_ray_kwargs

    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t")
    token.chmod(0o644)
    harden_local_ray()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    if sys.platform == "linux":
        assert local_ray_kwargs()["_node_ip_address"].startswith("127.")


def test_a_new_trainer_may_restart_the_version_order_once(engine):
    """After an authenticated group join (a trainer resumed from an older checkpoint) the first update
    may carry any version >= 0; after it, versions move forward again."""
    norm = _weights(engine)["model.norm.weight"]
    engine.load_weights([("model.norm.weight", norm)], engine.weight_version + 5)
    engine.restart_version_order()
    with pytest.raises(ValueError, match="not larger"):
        engine.load_weights([("model.norm.weight", norm)], -1)
    assert engine.load_weights([("model.norm.weight", norm)], 1) == 1
    with pytest.raises(ValueError, match="not larger"):
        engine.load_weights([("model.norm.weight", norm)], 0)


@pytest.mark.parametrize(
    "named, reason",
    [
        ("repeated", "appears twice in one update"),
        ("rope buffer", "not a parameter"),
    ],
)
def test_a_load_with_a_repeated_name_or_a_rope_buffer_changes_nothing(engine, named, reason):
    """Before, the second copy of a repeated name won and an inv_freq tensor was silently skipped."""
    before, version = _weights(engine), engine.weight_version
    norm = before["model.norm.weight"]
    extra = {
        "repeated": ("model.norm.weight", torch.zeros_like(norm)),
        "rope buffer": ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)),
    }[named]
    with pytest.raises(ValueError, match=reason):
        engine.load_weights([("model.norm.weight", norm + 1), extra], version + 1)
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.weight_version == version


def test_an_absurd_weight_version_is_refused_and_normal_updates_go_on(engine):
    norm = _weights(engine)["model.norm.weight"]
    version = engine.weight_version
    with pytest.raises(ValueError, match="above 2147483647"):
        engine.load_weights([("model.norm.weight", norm)], 10**30)
    assert engine.weight_version == version
    assert engine.load_weights([("model.norm.weight", norm)], version + 1) == version + 1
