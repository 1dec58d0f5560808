"""Actor <-> embedded engine (real subprocess, real gloo weight-sync group, fp32 on CPU):
after a weight sync the engine's greedy outputs equal HF greedy decoding with the actor's weights, and
with lr = 0 the ratio |pi/pi_old - 1| equals the rollout-training logprob gap, both <= 1e-4."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandemrl.rollout.client import EngineClient
from tandemrl.rollout.engine_process import EngineProcess
from tandemrl.rollout.weight_sync import WeightSender
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.batching import TrainSample
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples

PROMPTS = [[1, 504, 3107, 314, 260], [1, 2543, 28, 17, 4], [1, 9, 99, 999, 42, 7, 1200]]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with EngineProcess(tiny_llama_dir, device="cpu", dtype="float32", max_context_len=512) as proc:
        yield proc


async def _generate(url: str, prompts, params) -> list:
    client = EngineClient(url)
    try:
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))
    finally:
        await client.close()


async def _sync(actor: Actor, url: str) -> tuple[dict, str]:
    client = EngineClient(url)
    sender = WeightSender([client], backend="gloo", bucket_mb=1)
    try:
        await sender.connect()
        metrics = await actor.sync_weights(sender)
        return metrics, await client.get_weight_version()
    finally:
        await client.close()


def _hf_greedy(actor: Actor, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(actor.hf_model.config, dtype=torch.float32)
    missing, _ = model.load_state_dict(dict(actor.iter_full_weights(torch.float32)), strict=False)
    assert set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=GREEDY["max_new_tokens"],
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
            )[0, len(p) :]
            outs.append(ids.tolist())
    return outs


def test_engine_greedy_equals_actor_hf_greedy_after_sync(engine, tiny_llama_dir):
    torch.set_num_threads(1)
    actor = Actor(cpu_actor_setup(tiny_llama_dir, "actor.optim.lr=0.05", "algorithm.n_minibatches=1"))
    before = [r.output_ids for r in asyncio.run(_generate(engine.url, PROMPTS, GREEDY))]
    actor.train_step(make_samples(seed=0, num_samples=4))

    async def sync_and_generate():
        metrics, version = await _sync(actor, engine.url)
        return metrics, version, await _generate(engine.url, PROMPTS, GREEDY)

    metrics, version, results = asyncio.run(sync_and_generate())
    after = [r.output_ids for r in results]
    print(
        f"weight sync: {metrics['sync_weights/bytes'] / 1e6:.1f} MB in {metrics['time/sync_weights']:.3f} s"
    )
    assert str(version) == str(actor.weight_version) == "1"
    assert metrics["sync_weights/bytes"] == sum(t.numel() * 4 for _, t in actor.iter_full_weights())
    assert after != before, "the update must change the engine's greedy outputs"
    assert after == _hf_greedy(actor, PROMPTS)


def test_lr0_ratio_equals_rollout_training_gap(engine, tiny_llama_dir):
    """Sampled rollouts (temperature 1) from the engine at the actor's weights: with lr = 0 the PPO ratio
    only measures how far the engine's logprobs are from the trainer's."""
    torch.set_num_threads(1)
    actor = Actor(
        cpu_actor_setup(
            tiny_llama_dir, "actor.optim.lr=0.0", "algorithm.n_minibatches=1", "actor.micro_batch_tokens=64"
        )
    )
    asyncio.run(_sync(actor, engine.url))  # the engine may hold another test's weights
    results = asyncio.run(_generate(engine.url, PROMPTS * 2, {"max_new_tokens": 16, "temperature": 1.0}))
    samples = [
        TrainSample(
            p + r.output_ids,
            [0] * len(p) + [1] * len(r.output_ids),
            [0.0] * len(p) + list(r.output_logprobs),
            1.0 if i % 2 else -1.0,
        )
        for i, (p, r) in enumerate(zip(PROMPTS * 2, results, strict=True))
    ]
    metrics = actor.train_step(samples)
    ratio, gap = metrics["train/actor/ratio_abs"], metrics["train/actor/rollout_train_logprob_gap"]
    print(f"ratio_abs={ratio:.3e} rollout_train_logprob_gap={gap:.3e}")
    assert ratio <= 1e-4 and gap <= 1e-4
    assert abs(ratio - gap) <= 1e-6
    assert metrics["train/actor/num_tokens"] == sum(len(r.output_ids) for r in results)
