"""GPU twins of the engine's CPU tests (skipped without CUDA): greedy == HF on CUDA (fp32, no TF32), and a
weight update through CUDA IPC handles on one GPU between this process and an engine process."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.config.engine import EngineOptions
from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.sequence import SamplingParams
from tandemrl.rollout.client import EngineClient
from tandemrl.rollout.engine_process import EngineProcess
from tandemrl.rollout.weight_sync import WeightSender
from tests.unit.test_engine_greedy import NUM_REQUESTS, random_prompts, run_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm2"])
def test_cuda_engine_greedy_matches_hf(arch, tiny_model_factory, smollm2_dir):
    model_dir = smollm2_dir if arch == "smollm2" else tiny_model_factory(arch)
    engine = Engine(
        EngineConfig(
            str(model_dir),
            device="cuda",
            dtype="float32",
            max_context_len=256,
            max_running_requests=NUM_REQUESTS,
            kv_cache_gb=1.0,
        )
    )
    prompts = random_prompts(NUM_REQUESTS, seed=5)
    params = [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)] * NUM_REQUESTS
    done = run_engine(engine, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for i, prompt in enumerate(prompts):
        seq = done[str(i)]
        assert seq.output_ids == hf_greedy(hf, prompt, 16), f"request {i}"
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + seq.output_ids], device="cuda")).logits[
                0, len(prompt) - 1 : -1
            ]
        reference = (
            torch.log_softmax(logits.float(), -1)
            .gather(-1, torch.tensor(seq.output_ids, device="cuda")[:, None])
            .squeeze(-1)
            .cpu()
        )
        torch.testing.assert_close(torch.tensor(seq.output_logprobs), reference, atol=1e-3, rtol=0)


def test_cuda_ipc_weight_update(tiny_model_factory, tiny_llama_dir):
    other_dir = tiny_model_factory("llama", seed=1)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).cuda().eval()
    prompt = [1, 2817, 314, 1060, 47, 87, 17]
    expected = hf_greedy(other, prompt, 12)
    with EngineProcess(
        tiny_llama_dir,
        device="cuda",
        dtype="float32",
        max_context_len=256,
        options=EngineOptions(kv_cache_gb=0.5),
        env={"NVIDIA_TF32_OVERRIDE": "0"},
    ) as engine:

        async def run():
            client = EngineClient(engine.url)
            sender = WeightSender([client], backend="cuda_ipc", bucket_mb=4, is_one_bucket=True)
            await sender.connect()
            start = time.perf_counter()
            stats = await sender.push(other.state_dict().items(), weight_version=5)
            print(
                f"CUDA IPC push: {stats['bytes'] / 2**20:.1f} MiB in {time.perf_counter() - start:.3f} s, "
                f"{stats['num_buckets']} buckets"
            )
            result = await client.generate(
                prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
            )
            await client.close()
            return stats, result

        stats, result = asyncio.run(run())
    # bucket_mb=4 would cut these weights in several; the runner's sender to the embedded engine sends one,
    # loaded between two steps (rollout/backends.py, pushes_atomically); test_actor_gpu pushes in several
    assert stats["num_buckets"] == 1 and stats["bytes"] > 4 * 2**20
    assert result.weight_version == "5" and result.weight_versions == [5] * 12
    assert result.output_ids == expected
