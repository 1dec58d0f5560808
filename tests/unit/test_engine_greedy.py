"""Greedy outputs of the engine equal HF `generate` token for token, and returned logprobs equal a full
HF forward pass within 1e-4, for tiny Llama / Qwen2 / Qwen3 and SmolLM2 (fp32, CPU), with 16 concurrent
requests of different lengths batched together (in-process engine, no HTTP)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.sequence import SamplingParams

NUM_REQUESTS = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def random_prompts(num: int, seed: int, min_len: int = 3, max_len: int = 48) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (num,), generator=generator)
    return [torch.randint(3, 49152, (int(n),), generator=generator).tolist() for n in lengths]


def run_engine(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_work():
        for seq in engine.step():
            assert seq.rid not in done, "a request finished twice"
            done[seq.rid] = seq
    assert len(done) == len(prompts)
    return done


def check_against_hf(model_dir, prompts, done, greedy_rows, max_new_tokens) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        seq = done[str(i)]
        assert len(seq.output_ids) == max_new_tokens
        if i in greedy_rows:
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            assert seq.output_ids == expected, f"request {i}: engine {seq.output_ids} != HF {expected}"
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + seq.output_ids])).logits[0, len(prompt) - 1 : -1].float()
        reference = (
            torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.output_ids)[:, None]).squeeze(-1)
        )
        torch.testing.assert_close(torch.tensor(seq.output_logprobs), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    engine = Engine(EngineConfig(str(model_dir), max_context_len=256, max_running_requests=NUM_REQUESTS))
    prompts = random_prompts(NUM_REQUESTS, seed=1)
    greedy_rows = set(range(0, NUM_REQUESTS, 2))  # the odd rows sample at T = 1: their logprobs are checked
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.0 if i in greedy_rows else 1.0, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    done = run_engine(engine, prompts, params)
    check_against_hf(model_dir, prompts, done, greedy_rows, 24)
    assert engine.stats()["num_free_blocks"] == engine.blocks.num_blocks  # every block came back


def test_retraction_under_memory_pressure_keeps_greedy_outputs(tiny_llama_dir):
    """A KV pool too small for all requests forces retraction and re-prefill; outputs must not change."""
    engine = Engine(
        EngineConfig(
            str(tiny_llama_dir),
            max_context_len=128,
            max_running_requests=NUM_REQUESTS,
            kv_cache_gb=12 * 16 * 2 * 2 * 2 * 16 * 4 / 2**30,
        )
    )  # 12 blocks of 16 tokens
    prompts = random_prompts(NUM_REQUESTS, seed=2, max_len=40)
    params = [SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)] * NUM_REQUESTS
    done = run_engine(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    check_against_hf(tiny_llama_dir, prompts, done, set(range(NUM_REQUESTS)), 20)


def test_bad_prompts_are_refused_and_nothing_is_queued(tiny_llama_dir):
    """`validate` (the engine's and the server's check) names what is wrong; a refused request is not added."""
    engine = Engine(EngineConfig(str(tiny_llama_dir), max_context_len=64))
    vocab = engine.model.cfg["vocab_size"]
    params = SamplingParams(max_new_tokens=2)
    for bad in ([1, 2.0], [1, "2"], [1, None], [-1, 2], [1, vocab], [2**40], [1, 2**70]):
        with pytest.raises(ValueError, match=rf"token ids in \[0, {vocab}\)"):
            engine.add_request("bad", bad, params)
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.add_request("bad", [], params)
    with pytest.raises(ValueError, match="max_context_len"):
        engine.add_request("bad", [1] * 64, params)
    assert not engine.has_work() and engine.stats()["num_requests_added"] == 0
    engine.add_request("ok", [0, vocab - 1], params)  # both ends of the vocabulary are token ids
    assert engine.has_work()


def test_smollm2_matches_hf(smollm2_dir):
    engine = Engine(
        EngineConfig(
            str(smollm2_dir), dtype="float32", max_context_len=256, max_running_requests=NUM_REQUESTS
        )
    )
    prompts = random_prompts(NUM_REQUESTS, seed=3, max_len=32)
    params = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)] * NUM_REQUESTS
    done = run_engine(engine, prompts, params)
    check_against_hf(smollm2_dir, prompts, done, set(range(NUM_REQUESTS)), 8)
