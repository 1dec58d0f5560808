"""The sampler's distribution: chi-square tests of the first token over 20,000 draws (T = 1, T = 0.7),
top-p truncation and top-k, on logits from a real tiny model made peaky so the test has power."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.sampler import sample
from tandemrl.engine.sequence import SamplingParams, Sequence

NUM_SAMPLES = 20_000
CHUNK = 5_000
SCALE = 9.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def small_vocab_llama_dir(tmp_path_factory, smollm2_dir):
    """A 2-layer random Llama with a 4,096-token vocabulary: 20,000 draws stay cheap on CPU."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("small_vocab_llama")
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def first_token_logits(small_vocab_llama_dir) -> torch.Tensor:
    """Next-token logits of a prompt under the tiny model, its final norm scaled so the distribution is peaky."""
    engine = Engine(EngineConfig(str(small_vocab_llama_dir), max_context_len=64, max_running_requests=1))
    with torch.no_grad():
        engine.model.model.norm.weight.mul_(SCALE)
    seq = engine.add_request("r", [1, 523, 2174, 28], SamplingParams())
    engine.scheduler.schedule()
    return engine.runner.forward_logits([seq])[0]


def draw(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens, logprobs = [], []
    for _ in range(NUM_SAMPLES // CHUNK):
        batch = logits[None, :].expand(CHUNK, -1)
        t, lp = sample(
            batch,
            torch.full((CHUNK,), temperature),
            torch.full((CHUNK,), top_p),
            torch.full((CHUNK,), top_k, dtype=torch.long),
            generator,
        )
        tokens.append(t)
        logprobs.append(lp)
    return torch.cat(tokens), torch.cat(logprobs)


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, tokens with expected count < 5 pooled into one bin."""
    expected = probs.double().numpy() * len(tokens)
    observed = np.bincount(tokens.numpy(), minlength=len(expected)).astype(float)
    big = expected >= 5
    assert big.sum() >= 5, "distribution too flat for a meaningful test"
    exp_bins = np.append(expected[big], expected[~big].sum())
    obs_bins = np.append(observed[big], observed[~big].sum())
    if exp_bins[-1] < 5:  # fold a tiny remainder into the smallest big bin
        exp_bins[-2] += exp_bins[-1]
        obs_bins[-2] += obs_bins[-1]
        exp_bins, obs_bins = exp_bins[:-1], obs_bins[:-1]
    return float(chisquare(obs_bins, exp_bins * obs_bins.sum() / exp_bins.sum()).pvalue)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_matches_softmax_over_temperature(first_token_logits, temperature):
    tokens, logprobs = draw(first_token_logits, temperature)
    probs = torch.softmax(first_token_logits / temperature, -1)
    pvalue = chi_square_pvalue(tokens, probs)
    print(f"T={temperature}: chi-square p={pvalue:.3f}, {int((probs * NUM_SAMPLES >= 5).sum())} bins")
    assert pvalue > 1e-3
    # The test has power: the same draws reject the distribution at the other temperature.
    other = torch.softmax(first_token_logits / (1.7 - temperature), -1)
    assert chi_square_pvalue(tokens, other) < 1e-6
    # Logprobs are those of softmax(logits / T).
    torch.testing.assert_close(logprobs, probs.log()[tokens], atol=1e-5, rtol=0)


def test_top_p_truncates_to_the_nucleus(first_token_logits):
    top_p = 0.9
    tokens, logprobs = draw(first_token_logits, 1.0, top_p=top_p, seed=1)
    probs = torch.softmax(first_token_logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    nucleus = order[mass_before <= top_p]
    assert 5 < len(nucleus) < len(probs) // 2
    in_nucleus = torch.zeros_like(probs, dtype=torch.bool)
    in_nucleus[nucleus] = True
    assert bool(in_nucleus[tokens].all()), "a token outside the top-p nucleus was sampled"
    truncated = torch.where(in_nucleus, probs, torch.zeros_like(probs))
    truncated = truncated / truncated.sum()
    pvalue = chi_square_pvalue(tokens, truncated)
    print(f"top_p={top_p}: nucleus {len(nucleus)} tokens, chi-square p={pvalue:.3f}")
    assert pvalue > 1e-3
    torch.testing.assert_close(logprobs, truncated.log()[tokens], atol=1e-5, rtol=0)


def test_top_k_and_greedy_rows_in_one_batch(first_token_logits):
    logits = first_token_logits[None, :].expand(4, -1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(
        logits,
        torch.tensor([0.0, 1.0, 1.0, 1.0]),
        torch.tensor([1.0, 1.0, 1.0, 0.5]),
        torch.tensor([-1, 1, 3, -1]),
        generator,
    )
    top3 = first_token_logits.topk(3).indices
    assert tokens[0] == top3[0] and tokens[1] == top3[0]
    assert tokens[2] in top3
    raw = torch.log_softmax(first_token_logits, -1)
    assert logprobs[0] == pytest.approx(float(raw[top3[0]]), abs=1e-6)  # greedy: model logprob at T=1
    assert logprobs[1] == pytest.approx(0.0, abs=1e-6)  # top-k 1 leaves a point mass


def test_full_sort_fallback_when_the_nucleus_is_wide():
    """A flat distribution: the nucleus is wider than the candidate shortcut, so the sampler sorts all."""
    logits = torch.zeros(2, 5000)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, torch.ones(2), torch.full((2,), 0.5), torch.full((2,), -1), generator)
    assert bool((tokens < 5000).all())
    expected = -np.log(np.floor(0.5 * 5000) + 1)  # tokens whose mass before is <= 0.5
    assert logprobs.tolist() == pytest.approx([expected] * 2, abs=1e-4)


def test_sequence_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": -1})
    with pytest.raises(ValueError, match="unknown sampling_params"):
        SamplingParams.from_dict({"max_tokens": 3})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="not supported"):
        SamplingParams.from_dict({"repetition_penalty": 1.2})
    params = SamplingParams.from_dict({"stop": "</answer>", "temperature": 0, "repetition_penalty": 1.0})
    assert params.stop == ["</answer>"] and params.is_greedy
    assert Sequence("r", [1], params, 10).num_tokens == 1
