"""SFT on the actor's machinery: the loss is the token-mean NLL of the masked tokens (checked against a
plain HF forward), it goes down, and `tandem sft` on pre-rendered samples writes a loadable HF model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import yaml

from tandemrl.trainer.actor import Actor
from tandemrl.trainer.sft import write_rendered
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples


def _hf_token_mean_nll(model_dir, samples) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logp = model(input_ids=torch.tensor([s.input_ids])).logits[0].log_softmax(-1)
            for t in range(1, s.num_tokens):
                if s.loss_mask[t]:
                    total -= float(logp[t - 1, s.input_ids[t]])
                    tokens += 1
    return total / tokens


def test_sft_step_is_token_mean_nll_and_learns(tiny_llama_dir):
    torch.set_num_threads(1)
    samples = make_samples(seed=3, num_samples=4)
    actor = Actor(cpu_actor_setup(tiny_llama_dir, "actor.optim.lr=0.01", "actor.micro_batch_tokens=64"))
    first = actor.sft_step(samples)
    assert abs(first["train/sft/loss"] - _hf_token_mean_nll(tiny_llama_dir, samples)) < 1e-4
    assert first["train/sft/num_tokens"] == sum(s.num_loss_tokens for s in samples)
    losses = [actor.sft_step(samples)["train/sft/loss"] for _ in range(4)]
    assert losses[-1] < first["train/sft/loss"] - 0.5


def test_tandem_sft_on_rendered_samples_writes_hf_model(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tandemrl.commands.sft import run_sft

    torch.set_num_threads(1)
    rendered = tmp_path / "rendered.jsonl"
    write_rendered(rendered, make_samples(seed=5, num_samples=6))  # the file `tandem sft` writes
    config = {
        "runner": {"output_dir": str(tmp_path / "run")},
        "actor": {
            "model": {"model_path": str(tiny_llama_dir)},
            "device": "cpu",
            "sft": {"rendered_path": str(rendered), "num_epochs": 3, "batch_size": 3, "lr": 0.01},
        },
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert run_sft(argparse.Namespace(config=str(tmp_path / "sft.yaml"), overrides=[])) == 0
    history = [
        json.loads(line) for line in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(history) == 6
    assert history[-1]["train/sft/loss"] < history[0]["train/sft/loss"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "sft_model")
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(model.state_dict()[name], initial.state_dict()[name])
    assert (tmp_path / "run" / "sft_model" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_tandem_sft_renders_demos_with_the_real_retriever(prepared_home, tiny_llama_dir, tmp_path):
    """Knowledge base -> MiniLM/Qdrant index -> retrieval server -> rendered demos -> SFT -> HF model."""
    from transformers import AutoTokenizer

    from tandemrl.commands.sft import run_sft
    from tandemrl.data.kb import generate_kb
    from tandemrl.retrieval.build import build_index

    kb = generate_kb(tmp_path / "kb", seed=0, num_entities=80, num_train=40, num_val=5, num_test=5)
    build_index(kb / "corpus.jsonl", tmp_path / "index", batch_size=64, show_progress=False)
    config = {
        "runner": {"output_dir": str(tmp_path / "run")},
        "retrieval": {"index_dir": str(tmp_path / "index")},
        "actor": {
            "model": {"model_path": str(tiny_llama_dir)},
            "device": "cpu",
            "sft": {"demos_path": str(kb / "demos.jsonl"), "num_demos": 8, "batch_size": 4, "lr": 0.01},
        },
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert run_sft(argparse.Namespace(config=str(tmp_path / "sft.yaml"), overrides=[])) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "sft" / "rendered.jsonl").read_text().splitlines()
    ]
    assert rows
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    row = rows[0]
    masked_out = tokenizer.decode(
        [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m]
    )
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert "<information>" in masked_out and "Doc 1(Title:" in masked_out  # retrieved text is not trained on
    assert "<search>" in trained and "<answer>" in trained and "<information>" not in trained
    assert (tmp_path / "run" / "sft_model" / "config.json").is_file()
