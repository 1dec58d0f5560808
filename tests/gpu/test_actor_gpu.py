"""The actor's bf16 path: on CUDA, bf16 compute over fp32 master weights gives the same step as fp32
(within bf16 tolerance); the CPU twin runs the identical comparison with bf16 compute on the CPU."""

from __future__ import annotations

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.trainer.actor import Actor
from tests.integration.trainer_helpers import make_samples

VOCAB = 512


def _tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         use_sliding_window=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _step(device: str, dtype: str):
    torch.set_num_threads(1)
    model = _tiny_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = load_config(None, [f"actor.device={device}", f"actor.dtype={dtype}", "actor.optim.lr=0.001",
                                "algorithm.n_minibatches=2", "algorithm.recompute_logprobs=true",
                                "actor.micro_batch_tokens=64", "runner.output_dir=/tmp/tandem-unused"])
    actor = Actor(config, hf_model=model)
    metrics = actor.train_step(make_samples(seed=0, num_samples=6, vocab=VOCAB))
    deltas = {n: t.float().cpu() - initial[n] for n, t in actor.iter_full_weights(torch.float32)}
    return actor, metrics, deltas


def _compare_to_fp32(device: str) -> None:
    actor, low, low_delta = _step(device, "bfloat16")
    assert actor.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in actor.policy.parameters())  # fp32 master weights
    _, ref, ref_delta = _step("cpu", "float32")
    assert low["train/actor/loss"] == pytest.approx(ref["train/actor/loss"], abs=2e-2)
    assert low["train/actor/entropy"] == pytest.approx(ref["train/actor/entropy"], rel=1e-2)
    assert low["train/actor/grad_norm"] == pytest.approx(ref["train/actor/grad_norm"], rel=5e-2)
    a = torch.cat([low_delta[k].flatten() for k in ref_delta])
    b = torch.cat([ref_delta[k].flatten() for k in ref_delta])
    assert b.abs().max() > 1e-4  # the step moved the weights
    cosine = float(a @ b / (a.norm() * b.norm()))
    assert cosine > 0.9, f"bf16 update direction differs from fp32 (cosine {cosine:.3f})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_train_step_on_cuda_matches_fp32():
    _compare_to_fp32("cuda")


def test_cpu_twin_bf16_compute_matches_fp32():
    _compare_to_fp32("cpu")
