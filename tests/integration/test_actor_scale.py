"""benchmarks/actor/actor_scale.py end to end on the CPU with the tiny shape: each run a real child process
(model built on the device, `Actor`, a warm-up and a timed `train_step`), alone and beside a process holding
the engine's memory, and the JSON the issue asks for. Its figures are the H200's to make; this checks that
the runs happen and the report adds up."""

from __future__ import annotations

import json

from benchmarks.actor.actor_scale import main

TRAJECTORIES, TOKENS = 8, 32
# every smoke run: the tiny shape on the CPU, a small GRPO batch
SMOKE_ARGS = [
    "--sizes",
    "tiny",
    "--device",
    "cpu",
    "--trajectories",
    str(TRAJECTORIES),
    "--tokens",
    str(TOKENS),
]


def test_smoke_run_trains_tiny_alone_and_beside_the_engine(tmp_path, capsys):
    out = tmp_path / "actor_scale.json"
    common = SMOKE_ARGS
    assert main([*common, "--out", str(out)]) == 0
    assert main([*common, "--out", str(out), "--beside-engine", "--merge"]) == 0  # the second mode, added

    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "MFU against 989 TFLOPS" in printed and "tiny alone offload=off: step" in printed
    assert {"sizes", "largest_alone", "largest_beside_engine", "runs", "settings", "flops"} <= set(result)
    assert result["largest_alone"] == result["largest_beside_engine"] == "tiny"
    assert [(r["mode"], r["offload"]) for r in result["runs"]] == [("alone", False), ("beside_engine", False)]
    assert len(result["commands"]) == 2
    entry = result["sizes"]["tiny"]
    assert {"trained", "peak_gpu_gib", "step_s", "tokens_per_s", "mfu", "offload"} <= set(entry)
    assert entry["trained"] is True and entry["offload"] is False and entry["step_s"] > 0
    assert entry["tokens_per_s"] == TRAJECTORIES * TOKENS / entry["step_s"]
    assert 0 < entry["mfu"] < entry["hfu"]
    for record in result["runs"]:
        assert record["trained"], record.get("error")
        assert record["tokens_per_step"] == TRAJECTORIES * TOKENS and record["loss_tokens_per_step"] > 0
        assert record["num_skipped_updates"] == 0, "the random model's gradients were finite"
        assert record["gradient_checkpointing"] is True and record["n_minibatches"] == 1
    beside = result["runs"][1]
    assert beside["engine_gib"] == result["engine"]["gib"]["tiny"] > 0
    assert result["runs"][0]["param_dtype"] == "float32"
    assert result["runs"][0]["state_gib"] == 16 * result["runs"][0]["num_params"] / 2**30


def test_smoke_run_trains_tiny_with_bf16_weights_and_moments(tmp_path):
    """--param-dtype/--state-dtype: the run's actor holds bf16 weights and moments, 8 bytes a parameter."""
    out = tmp_path / "actor_scale_bf16.json"
    assert (
        main([*SMOKE_ARGS, "--param-dtype", "bfloat16", "--state-dtype", "bfloat16", "--out", str(out)]) == 0
    )
    (record,) = json.loads(out.read_text())["runs"]
    assert record["trained"], record.get("error")
    assert (record["param_dtype"], record["state_dtype"]) == ("bfloat16", "bfloat16")
    assert record["state_gib"] == 8 * record["num_params"] / 2**30
    assert record["num_skipped_updates"] == 0
