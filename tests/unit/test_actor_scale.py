"""benchmarks/actor/actor_scale.py's pieces that decide its figures: the Qwen2.5 shapes (their parameter
counts are the published ones), the model built on the device with its buffers and ties intact, the FLOPs
behind MFU, the engine's memory, the summary's largest sizes, and the refusals made before any run. The runs
themselves are checked end to end on the CPU in tests/integration/test_actor_scale.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.actor.actor_scale import check_config, engine_gib, load_previous, parse_args, summarise, write
from benchmarks.actor.actor_scale_run import SHAPES, build_model, flops_per_step, param_counts


@pytest.mark.parametrize(
    ("size", "num_params", "is_tied"),
    [
        ("qwen2.5-1.5b", 1_543_714_304, True),
        ("qwen2.5-3b", 3_085_938_688, True),
        ("qwen2.5-7b", 7_615_616_512, False),
    ],
)
def test_the_shapes_are_qwen25s(size, num_params, is_tied):
    config = Qwen2Config(**SHAPES[size])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert param_counts(model)["num_params"] == num_params  # the model cards' counts
    assert config.tie_word_embeddings is is_tied
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 32768


def test_the_model_is_built_on_the_device_with_its_buffers_and_ties():
    torch.manual_seed(0)
    model = build_model(SHAPES["tiny"], torch.device("cpu"), "sdpa")
    reference = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES["tiny"]))
    assert model.lm_head.weight is model.model.embed_tokens.weight, "to_empty unties; the build re-ties"
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():  # the rotary inverse frequencies, not to_empty's garbage
        assert torch.equal(buffer, buffers[name]), name
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert torch.equal(params["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64))
    assert abs(params["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002
    counts = param_counts(model)
    assert counts["num_body_params"] == counts["num_params"] - 1024 * 64  # the tied matrix once, as the head


def test_flops_count_the_head_on_loss_tokens_and_the_recompute_only_when_checkpointed():
    counts = {"num_params": 0, "num_body_params": 10, "num_head_params": 3}
    body, head = 2 * 10 * 100, 2 * 3 * 20  # forward FLOPs: every token through the body, loss tokens the head
    checkpointed = flops_per_step(counts, tokens=100, loss_tokens=20, is_checkpointed=True)
    assert checkpointed == (3 * (body + head), 4 * (body + head))
    assert flops_per_step(counts, tokens=100, loss_tokens=20, is_checkpointed=False) == (
        3 * (body + head),
        3 * (body + head) + head,  # the logit chunks are recomputed in backward all the same
    )


def test_the_engine_holds_its_bf16_weights_and_default_kv_cache():
    args = parse_args([])
    # 7B: 2 bytes x 7,615,616,512 weights; 64 requests x 4,096 tokens x 2 (K, V) x 28 layers x 4 heads x 128 x 2 bytes
    expected = (2 * 7_615_616_512 + 64 * 4096 * 2 * 28 * 4 * 128 * 2) / 2**30
    assert engine_gib("qwen2.5-7b", args) == pytest.approx(expected)
    smaller = parse_args(["--override", "rollout.max_context_len=3072"])
    assert engine_gib("qwen2.5-7b", smaller) < expected
    assert engine_gib("qwen2.5-7b", parse_args(["--engine-gib", "12"])) == 12


def run(size: str, mode: str, offload: bool, trained: bool, tokens_per_s: float = 1.0) -> dict:
    record = {"size": size, "mode": mode, "offload": offload, "trained": trained, "command": "c"}
    return record | (
        {"tokens_per_s": tokens_per_s, "step_s": 1.0, "mfu": 0.3, "hfu": 0.4}
        if trained
        else {"error": "CUDA out of memory"}
    )


def test_the_summary_names_the_largest_size_each_mode_trained():
    runs = [
        run("qwen2.5-1.5b", "alone", False, True, 30.0),
        run("qwen2.5-1.5b", "alone", True, True, 10.0),
        run("qwen2.5-7b", "alone", False, False),
        run("qwen2.5-7b", "alone", True, True, 2.0),
        run("qwen2.5-3b", "alone", False, True, 5.0),
    ]
    summary = summarise(runs)
    assert summary["largest_alone"] == "qwen2.5-7b"
    assert summary["largest_beside_engine"] is None and summary["modes_run"] == ["alone"]
    assert summary["largest_by_offload"] == {
        "alone": {"offload_off": "qwen2.5-3b", "offload_on": "qwen2.5-7b"}
    }
    assert list(summary["sizes"]) == ["qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"]
    assert summary["sizes"]["qwen2.5-1.5b"]["offload"] is False, "the fastest run that trained"
    assert summary["sizes"]["qwen2.5-7b"]["offload"] is True and summary["sizes"]["qwen2.5-7b"]["trained"]
    nothing = summarise([run("qwen2.5-7b", "beside_engine", False, False)])
    assert nothing["largest_beside_engine"] is None and nothing["modes_run"] == ["beside_engine"]
    assert nothing["sizes"]["qwen2.5-7b"] == nothing["sizes_beside_engine"]["qwen2.5-7b"]
    assert nothing["sizes"]["qwen2.5-7b"]["error"] == "CUDA out of memory"


def test_offload_and_bad_overrides_are_refused_before_any_run():
    args = parse_args(["--device", "cpu", "--offload"])
    with pytest.raises(SystemExit, match="actor.cpu_offload"):  # unknown key, or refused on a CPU actor
        check_config(args, [False, True])
    with pytest.raises(SystemExit, match="actor.no_such_key"):
        check_config(parse_args(["--device", "cpu", "--override", "actor.no_such_key=1"]), [False])


def test_offload_on_a_tree_without_the_key_says_so(monkeypatch):
    import benchmarks.actor.actor_scale as scale
    from tandemrl.config.errors import ConfigError

    def older_tree(path, overrides):
        """Stands in for a config schema from before actor.cpu_offload."""
        if "actor.cpu_offload=true" in overrides:
            raise ConfigError("unknown key actor.cpu_offload: actor has no such setting.")

    monkeypatch.setattr(scale, "load_config", older_tree)
    check_config(parse_args(["--offload"]), [False])
    with pytest.raises(SystemExit, match="does not have yet. Run without --offload"):
        check_config(parse_args(["--offload"]), [False, True])


def test_merge_keeps_other_runs_and_refuses_other_settings(tmp_path):
    out = str(tmp_path / "scale.json")
    first = parse_args(["--device", "cpu", "--out", out])
    write(first, None, [run("tiny", "alone", False, True)])
    again = parse_args(["--device", "cpu", "--out", out, "--merge"])
    merged = write(again, load_previous(again), [run("tiny", "beside_engine", False, True)])
    assert [r["mode"] for r in merged["runs"]] == ["alone", "beside_engine"]
    assert merged["largest_alone"] == merged["largest_beside_engine"] == "tiny"
    with pytest.raises(SystemExit, match="other settings"):
        load_previous(parse_args(["--device", "cpu", "--out", out, "--merge", "--tokens", "64"]))


def test_fallback_offloads_only_the_sizes_that_failed_without(tmp_path, monkeypatch):
    import benchmarks.actor.actor_scale as scale

    fits_without = {"qwen2.5-1.5b", "qwen2.5-3b"}
    started = []

    def fake_run_child(args, size, offload, mode):
        """Stands in for the child process: sizes above 3B fail without offload."""
        started.append((size, offload))
        return run(size, mode, offload, offload or size in fits_without)

    monkeypatch.setattr(scale, "run_child", fake_run_child)
    monkeypatch.setattr(scale, "check_config", lambda args, offloads: None)  # offload is refused on a CPU
    assert scale.main(["--device", "cpu", "--offload", "fallback", "--out", str(tmp_path / "s.json")]) == 0
    assert started == [
        ("qwen2.5-1.5b", False),
        ("qwen2.5-3b", False),
        ("qwen2.5-7b", False),
        ("qwen2.5-7b", True),
    ]
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["largest_alone"] == "qwen2.5-7b" and result["sizes"]["qwen2.5-7b"]["offload"] is True
    assert result["largest_by_offload"]["alone"] == {"offload_off": "qwen2.5-3b", "offload_on": "qwen2.5-7b"}


def test_precision_options_set_the_keys_and_their_own_results_file():
    """--param-dtype/--state-dtype become actor.param_dtype/actor.optim.state_dtype (only off the default, so
    an older results file still merges) and pick a results file of their own unless --out names one."""
    from benchmarks.actor.actor_scale import DEFAULT_OUT, actor_overrides

    plain = parse_args(["--device", "cpu"])
    assert plain.out == str(DEFAULT_OUT)
    assert not [o for o in actor_overrides(plain, False, "/tmp") if "dtype" in o]
    bf16 = parse_args(["--param-dtype", "bfloat16", "--state-dtype", "bfloat16"])
    assert bf16.out == str(DEFAULT_OUT.with_name("actor_scale_h200_param-bfloat16_state-bfloat16.json"))
    overrides = actor_overrides(bf16, False, "/tmp")
    assert {"actor.param_dtype=bfloat16", "actor.optim.state_dtype=bfloat16", "actor.dtype=bfloat16"} <= set(
        overrides
    )
    check_config(bf16, [False, True])  # a GPU actor: bf16 weights, offloaded or not, are accepted
    assert parse_args(["--param-dtype", "bfloat16", "--out", "x.json"]).out == "x.json"
