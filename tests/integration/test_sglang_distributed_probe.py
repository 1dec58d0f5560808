"""benchmarks/engine/sglang_distributed.py against the FAKE SGLang server (tests/fake_sglang.py, which keeps
SGLang 0.5.15's request structs and joins the weight group as its TP ranks do): the probe the GPU machine
points at a real server records each weight-update call with its answer, and a push that fails is recorded
and written, not lost. The fake runs no model, so its greedy output says nothing of the weights here."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoModelForCausalLM

from benchmarks.engine import sglang_distributed
from tests.integration.test_sglang_conformance import fake_sglang, fake_state, start_fake

__all__ = ["fake_sglang"]  # the module's own fake server (a module-scoped fixture)


def test_the_probe_records_every_weight_update_call_and_its_answer(fake_sglang, tiny_llama_dir, tmp_path):
    out = tmp_path / "probe.json"
    argv = ["--url", fake_sglang, "--model", str(tiny_llama_dir), "--bucket-mb", "1", "--out", str(out)]
    report = sglang_distributed.main(argv)
    assert json.loads(out.read_text())["calls"] == json.loads(json.dumps(report["calls"], default=str))
    assert "failed" not in report, report.get("failed")
    calls = report["calls"]
    init, *updates, finish = calls
    assert init["call"] == "init_weights_update_group" and init["answer"]["success"] is True
    assert init["args"][2:] == [1, 2, "tandem_weight_sync", "gloo"]  # rank_offset, world_size, group, backend
    assert [c["call"] for c in updates] == ["update_weights_from_distributed"] * len(updates)
    assert all(c["answer"]["success"] is True for c in updates)
    assert finish["call"] == "finish_weight_update" and finish["args"] == [1, True] and "error" not in finish
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    names = [n for n, _ in model.named_parameters()]
    sent = sum(c["args"][0]["len"] if isinstance(c["args"][0], dict) else len(c["args"][0]) for c in updates)
    assert sent == len(names)
    state = asyncio.run(fake_state(fake_sglang))
    assert set(names) <= set(state["received"])
    # the pushed weights are the served model's with each MLP down-projection halved
    down = next(n for n in names if n.endswith("mlp.down_proj.weight"))
    halved = float(dict(model.named_parameters())[down].detach().double().sum()) * 0.5
    assert state["received"][down] == pytest.approx(halved, rel=1e-5)
    assert report["weight_version_after"] == "1" and report["push_changed_output"] is False


def test_a_push_that_fails_is_recorded_and_written(tiny_llama_dir, tmp_path):
    """An NCCL group on a machine without a GPU fails (on our side or the server's, whichever comes first):
    the failure is the result, written with the calls made so far, and no weights check is claimed."""
    proc, url = start_fake()  # a server of its own: a failed join may leave its group half made
    try:
        out = tmp_path / "failed.json"
        argv = ["--url", url, "--model", str(tiny_llama_dir), "--group-backend", "nccl", "--out", str(out)]
        report = sglang_distributed.main(argv)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert report["failed"] and "weights_check" not in report
    written = json.loads(out.read_text())
    assert written["failed"] == report["failed"] and written["group_backend"] == "nccl"
    assert [c["call"] for c in written["calls"]] == ["init_weights_update_group"]
