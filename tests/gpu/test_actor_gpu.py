"""The actor's bf16 path: on CUDA, bf16 compute over fp32 master weights, and bf16 weights
(`actor.param_dtype`), give the same step as fp32 (within bf16 tolerance); the CPU twins run the identical
comparisons on the CPU."""

from __future__ import annotations

import pytest
import torch

from tandemrl.config.derive import actor_setup
from tandemrl.config.loader import load_config
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.policy import is_sharded
from tests.integration.trainer_helpers import make_samples

VOCAB = 512


def _tiny_model(attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)


def _step(device: str, dtype: str, attn: str = "sdpa", *overrides: str):
    torch.set_num_threads(1)
    model = _tiny_model(attn)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = load_config(
        None,
        [
            f"actor.device={device}",
            f"actor.dtype={dtype}",
            "actor.optim.lr=0.001",
            "algorithm.n_minibatches=2",
            "algorithm.recompute_logprobs=true",
            "actor.micro_batch_tokens=64",
            "runner.output_dir=/tmp/tandem-unused",
            *overrides,
        ],
    )
    actor = Actor(actor_setup(config), hf_model=model)
    metrics = actor.train_step(make_samples(seed=0, num_samples=6, vocab=VOCAB))
    deltas = {n: t.float().cpu() - initial[n] for n, t in actor.iter_full_weights(torch.float32)}
    return actor, metrics, deltas


def _compare_to_fp32(device: str) -> None:
    actor, low, low_delta = _step(device, "bfloat16")
    assert actor.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in actor.policy.parameters())  # fp32 master weights
    # one rank: the plain module under bf16 autocast (no FSDP copies per micro-batch), same on CPU and GPU
    assert not is_sharded(actor.policy) and actor.policy.autocast_dtype == torch.bfloat16
    _, ref, ref_delta = _step("cpu", "float32")
    assert low["train/actor/loss"] == pytest.approx(ref["train/actor/loss"], abs=2e-2)
    assert low["train/actor/entropy"] == pytest.approx(ref["train/actor/entropy"], rel=1e-2)
    assert low["train/actor/grad_norm"] == pytest.approx(ref["train/actor/grad_norm"], rel=5e-2)
    a = torch.cat([low_delta[k].flatten() for k in ref_delta])
    b = torch.cat([ref_delta[k].flatten() for k in ref_delta])
    assert b.abs().max() > 1e-4  # the step moved the weights
    cosine = float(a @ b / (a.norm() * b.norm()))
    print(
        f"bf16 vs fp32 on {device}: loss {low['train/actor/loss']:.5f} vs {ref['train/actor/loss']:.5f}, "
        f"grad_norm {low['train/actor/grad_norm']:.4f} vs {ref['train/actor/grad_norm']:.4f}, "
        f"cosine {cosine:.4f}"
    )
    assert cosine > 0.9, f"bf16 update direction differs from fp32 (cosine {cosine:.3f})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_train_step_on_cuda_matches_fp32():
    _compare_to_fp32("cuda")


def test_cpu_twin_bf16_compute_matches_fp32():
    _compare_to_fp32("cpu")


def _compare_bf16_weights_to_fp32(device: str, *overrides: str) -> None:
    """actor.param_dtype=bfloat16: bf16 weights with fp32 AdamW moments (stochastic rounding) give the fp32
    actor's step within bf16 tolerance, the plain module computing in bf16 without autocast."""
    actor, low, low_delta = _step(device, "bfloat16", "sdpa", "actor.param_dtype=bfloat16", *overrides)
    assert {p.dtype for p in actor.policy.parameters()} == {torch.bfloat16}
    moments = [s[k] for s in actor.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    _, ref, ref_delta = _step("cpu", "float32")
    assert low["train/actor/loss"] == pytest.approx(ref["train/actor/loss"], abs=2e-2)
    a = torch.cat([low_delta[k].flatten() for k in ref_delta])
    b = torch.cat([ref_delta[k].flatten() for k in ref_delta])
    assert b.abs().max() > 1e-4
    cosine = float(a @ b / (a.norm() * b.norm()))
    print(f"bf16 weights vs fp32 on {device} {overrides}: cosine {cosine:.4f}")
    assert cosine > 0.9, f"the bf16-weight update direction differs from fp32 (cosine {cosine:.3f})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_weights_on_cuda_step_as_fp32_offloaded_or_not():
    _compare_bf16_weights_to_fp32("cuda")
    _compare_bf16_weights_to_fp32("cuda", "actor.cpu_offload=true")


def test_cpu_twin_bf16_weights_step_as_fp32():
    _compare_bf16_weights_to_fp32("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_keeps_the_state_on_the_host_and_steps_as_without():
    """actor.cpu_offload: FSDP2 on one rank with its CPUOffloadPolicy; the fp32 masters (and so the optimizer
    state) on the host, the same bf16 step as the plain module within bf16 tolerance."""
    offloaded, low, low_delta = _step("cuda", "bfloat16", "sdpa", "actor.cpu_offload=true")
    assert is_sharded(offloaded.policy)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in offloaded.policy.parameters())
    _, ref, ref_delta = _step("cuda", "bfloat16")
    assert low["train/actor/loss"] == pytest.approx(ref["train/actor/loss"], abs=2e-2)
    a = torch.cat([low_delta[k].flatten() for k in ref_delta])
    b = torch.cat([ref_delta[k].flatten() for k in ref_delta])
    assert b.abs().max() > 1e-4
    assert float(a @ b / (a.norm() * b.norm())) > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_varlen_kernel_on_cuda_gives_the_step_of_padded_sdpa():
    """The packed rows through torch's varlen flash kernel (the actor's auto attention on CUDA without
    flash_attn) against sdpa over padded rows, both bf16; the CPU twin is
    tests/integration/test_actor_train.py::test_varlen_packed_rows_give_the_loss_and_grads_of_padded_sdpa."""
    from tandemrl.trainer.varlen import VARLEN_ATTN, register_varlen_attention, varlen_kernel_works

    assert varlen_kernel_works(torch.device("cuda", 0), torch.bfloat16)
    register_varlen_attention()
    varlen, packed, packed_delta = _step("cuda", "bfloat16", VARLEN_ATTN)
    padded_actor, padded, padded_delta = _step("cuda", "bfloat16", "sdpa")
    assert not varlen.is_padded and padded_actor.is_padded
    assert packed["train/actor/loss"] == pytest.approx(padded["train/actor/loss"], abs=1e-2)
    assert packed["train/actor/grad_norm"] == pytest.approx(padded["train/actor/grad_norm"], rel=2e-2)
    a = torch.cat([packed_delta[k].flatten() for k in padded_delta])
    b = torch.cat([padded_delta[k].flatten() for k in padded_delta])
    assert float(a @ b / (a.norm() * b.norm())) > 0.95


def _write_engine_dir(model, out_dir) -> None:
    """The model as an HF directory with a minimal word-level tokenizer (the engine needs one for stop
    strings; nothing here decodes text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(out_dir, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "hello": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        out_dir
    )


async def _sync_and_sample(actor: Actor, url: str, backend: str, prompts: list[list[int]]):
    from tandemrl.rollout.client import EngineClient
    from tandemrl.rollout.weight_sync import WeightSender

    client = EngineClient(url)
    try:
        sender = WeightSender([client], backend=backend, bucket_mb=1)
        await sender.connect()
        await actor.sync_weights(sender)
        version = await client.get_weight_version()
        params = {"max_new_tokens": 16, "temperature": 1.0, "stop_token_ids": []}
        results = [await client.generate(p, params) for p in prompts]
        return version, results
    finally:
        await client.close()


@pytest.mark.parametrize(
    "device,dtype,backend,tolerance",
    [
        pytest.param(
            "cuda",
            "bfloat16",
            "cuda_ipc",
            5e-2,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
        ("cpu", "float32", "gloo", 1e-4),  # the CPU twin
        ("cpu", "bfloat16", "gloo", 5e-2),  # the CPU twin of the GPU path: one rank, autocast, bf16 engine
    ],
)
def test_weight_sync_then_engine_logprobs_match_actor(tmp_path, device, dtype, backend, tolerance):
    """Train a step, push the weights (CUDA IPC on one GPU; gloo on CPU), sample from the engine: the
    engine's logprobs equal the actor's recomputation within the precision's tolerance."""
    import asyncio

    from tandemrl.rollout.engine_process import EngineProcess
    from tandemrl.trainer.batching import TrainSample

    torch.set_num_threads(1)
    model = _tiny_model()
    _write_engine_dir(model, tmp_path / "model")
    config = load_config(
        None,
        [
            f"actor.device={device}",
            f"actor.dtype={dtype}",
            "actor.optim.lr=0.01",
            "algorithm.n_minibatches=1",
            "runner.output_dir=/tmp/tandem-unused",
        ],
    )
    actor = Actor(actor_setup(config), hf_model=model)
    actor.train_step(make_samples(seed=0, num_samples=4, vocab=VOCAB))  # the engine's weights are now stale
    prompts = [[5, 17, 300, 42], [9, 8, 7], [100, 200, 300, 400, 500]]
    with EngineProcess(tmp_path / "model", device=device, dtype=dtype, max_context_len=256) as engine:
        version, results = asyncio.run(_sync_and_sample(actor, engine.url, backend, prompts))
    assert str(version) == "1"
    samples = [
        TrainSample(
            p + r.output_ids, [0] * len(p) + [1] * len(r.output_ids), [0.0] * len(p) + list(r.output_logprobs)
        )
        for p, r in zip(prompts, results, strict=True)
    ]
    recomputed = actor.compute_logprobs(samples)
    gaps = [
        abs(a - b)
        for s, lp in zip(samples, recomputed, strict=True)
        for a, b, m in zip(lp, s.old_logprobs, s.loss_mask, strict=True)
        if m
    ]
    print(f"{device}: mean |logp_actor - logp_engine| = {sum(gaps) / len(gaps):.2e} over {len(gaps)} tokens")
    assert len(gaps) == sum(len(r.output_ids) for r in results) > 0
    assert sum(gaps) / len(gaps) <= tolerance
