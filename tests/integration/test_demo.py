"""`tandem demo`'s cold start: it runs when the `coldstart` model is missing, is reused when present,
is redone with `--cold-start always`, is skipped with `never` or when the rollout serves another model,
and a bad mode is a clear error. Real SFT on a tiny HF model (pre-rendered samples: no retriever)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tandemrl.commands.demo import ensure_cold_start, is_model_dir, step_rewards
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.trainer.sft import write_rendered
from tests.integration.trainer_helpers import make_samples

WEIGHT = "model.layers.0.mlp.up_proj.weight"


def _demo_config(tmp_path, tiny_dir, model_path="coldstart"):
    rendered = tmp_path / "rendered.jsonl"
    write_rendered(rendered, make_samples(seed=7, num_samples=6))  # the file `tandem sft` writes
    config = {
        "runner": {"output_dir": str(tmp_path / "run")},
        "rollout": {"model": {"model_path": model_path}, "device": "cpu"},
        "actor": {
            "device": "cpu",
            "sft": {
                "init_model_path": str(tiny_dir),
                "rendered_path": str(rendered),
                "batch_size": 3,
                "lr": 0.01,
            },
        },
    }
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    return load_config(tmp_path / "demo.yaml", [])


def _weight(model_dir):
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")[WEIGHT].clone()  # not a view of the mmapped file


def test_cold_start_runs_when_missing_then_is_reused_or_redone(tiny_llama_dir, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    coldstart = tmp_path / "home" / "models" / "SmolLM2-135M-Instruct-coldstart"
    config = _demo_config(tmp_path, tiny_llama_dir)
    assert config.rollout.model.model_path == str(coldstart)
    assert config.actor.model.model_path == str(coldstart)  # the actor trains what the rollout serves

    assert ensure_cold_start(config, "auto") is True
    assert is_model_dir(coldstart)
    assert not coldstart.with_name(coldstart.name + ".partial").exists()
    first = _weight(coldstart)
    assert not torch.equal(first, _weight(tiny_llama_dir))  # fine-tuned, not a copy
    assert (tmp_path / "run" / "sft" / "metrics.jsonl").is_file()  # the cold start's log is the run's

    stamp = (coldstart / "model.safetensors").stat().st_mtime_ns
    assert ensure_cold_start(config, "auto") is False
    assert (coldstart / "model.safetensors").stat().st_mtime_ns == stamp
    assert ensure_cold_start(config, "never") is False

    (coldstart / "model.safetensors").write_bytes(b"")  # redone from the base model, not from this file
    assert ensure_cold_start(config, "always") is True
    assert torch.equal(_weight(coldstart), first)  # same seed, same demos: the same cold start


def test_no_cold_start_when_the_rollout_serves_another_model(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    config = _demo_config(tmp_path, tiny_llama_dir, model_path=str(tiny_llama_dir))
    assert ensure_cold_start(config, "always") is False
    assert not (tmp_path / "home" / "models").exists()


def test_cold_start_mode_is_checked(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    config = _demo_config(tmp_path, tiny_llama_dir)
    with pytest.raises(ConfigError, match="sometimes"):
        ensure_cold_start(config, "sometimes")


def test_step_rewards_reads_training_rows_only(tmp_path):
    rows = [{"step": 0, "val/em/all": 0.1}, {"step": 1, "rollout/reward/mean": 0.25}, {"step": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert step_rewards(tmp_path) == [0.25]
    assert step_rewards(tmp_path / "missing") == []


def test_demo_cli_takes_the_cold_start_mode_before_overrides():
    from tandemrl.cli import build_parser

    args = build_parser().parse_args(["demo", "--cold-start", "always", "runner.max_steps=1"])
    assert (args.cold_start, args.overrides) == ("always", ["runner.max_steps=1"])
    assert build_parser().parse_args(["demo"]).cold_start == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--cold-start", "sometimes"])
