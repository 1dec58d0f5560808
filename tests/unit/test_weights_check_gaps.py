"""The weights check's measure (trainer/greedy_gaps.py) and verdict (runner/weights_check.py): an engine's
greedy token passes when the actor ranks it within `runner.weights_check_tie_nats` of its own top."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.runner.weights_check import failure_message, judge
from tandemrl.trainer.greedy_gaps import argmax_gaps

PROMPT = [1, 504, 3107, 314, 260]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@torch.no_grad()
def step_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The next token's log-probabilities after `ids`, one forward pass per call (no teacher forcing)."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(step_logprobs(model, ids).argmax()))
    return ids[len(prompt) :]


def test_the_models_own_greedy_output_has_no_gap(model):
    own = greedy(model, PROMPT, 8)
    argmax, gaps = argmax_gaps(model, PROMPT, own)
    assert argmax == own and gaps == [0.0] * 8


def test_a_token_off_the_argmax_is_scored_by_how_far_below_the_top_it_is(model):
    own = greedy(model, PROMPT, 8)
    logprobs = step_logprobs(model, PROMPT + own[:3])
    rival = int(logprobs.argsort(descending=True)[5])  # the sixth most likely token at position 3
    engine = own[:3] + [rival] + own[4:]
    argmax, gaps = argmax_gaps(model, PROMPT, engine)
    assert argmax[:4] == own[:4] and gaps[:3] == [0.0] * 3
    assert gaps[3] == pytest.approx(float(logprobs.max() - logprobs[rival]), abs=1e-4) and gaps[3] > 0
    # after the divergence the actor follows the engine's prefix, not its own
    assert argmax[4] == int(step_logprobs(model, PROMPT + engine[:4]).argmax())


def scored(*gaps_per_probe: list[float]) -> list[tuple[list[int], list[float]]]:
    """The actor's view of two-token outputs [10, 11]: argmax 99 wherever the gap is above 0."""
    return [
        ([99 if g > 0 else t for t, g in zip([10, 11], gaps, strict=True)], gaps) for gaps in gaps_per_probe
    ]


def test_equal_output_is_exact_a_near_tie_passes_and_a_wide_gap_fails():
    engines = [[[10, 11], [10, 11]]]
    exact = judge(engines, [scored([0.0, 0.0], [0.0, 0.0])], 0.5)
    assert exact["weights_check"] and exact["exact"] and exact["divergences"] == []

    tie = judge(engines, [scored([0.0, 0.0], [0.0, 0.12])], 0.5)
    assert tie["weights_check"] and not tie["exact"] and tie["max_gap_nats"] == 0.12
    assert [(d["prompt"], d["first_position"], d["position"]) for d in tie["divergences"]] == [(1, 1, 1)]

    assert not judge(engines, [scored([0.0, 0.0], [0.0, 0.12])], 0.0)["weights_check"]  # 0: exact only
    wide = judge(engines, [scored([2.5, 0.3], [0.0, 0.12])], 0.5)
    assert not wide["weights_check"] and wide["max_gap_nats"] == 2.5


def test_a_failure_names_the_engine_the_probe_the_position_and_the_gap():
    report = judge([[[10, 11]], [[10, 11]]], [scored([0.0, 0.0]), scored([0.0, 3.25])], 0.5)
    report.update(weight_version=7, backend="vllm", prompts=["The capital of France is"])
    message = failure_message(report, "run/weights_check.json")
    assert message.startswith("after the weight sync to version 7, rollout engine 1 (vllm) answered ")
    assert "'The capital of France is' greedily with [10, 11]; at token 1 the actor puts" in message
    assert "3.25 nats below its own top 99, beyond runner.weights_check_tie_nats=0.5" in message
    assert message.endswith("(1 probe(s); run/weights_check.json)")


@pytest.mark.parametrize(
    "value, why",
    [
        ("-0.1", "must be a number of nats from 0 to 2.0"),
        ("2.5", "must be a number of nats from 0 to 2.0"),
        ("nan", "expected a finite number"),
        ("true", "expected a finite number"),
    ],
)
def test_the_tie_margin_is_a_number_of_nats_from_0_to_2(value, why):
    with pytest.raises(ConfigError, match=rf"runner.weights_check_tie_nats=\S+: .*{why}"):
        load_config(None, [f"runner.weights_check_tie_nats={value}"])
    assert load_config(None, ["runner.weights_check_tie_nats=0"]).runner.weights_check_tie_nats == 0


def test_the_robustness_benchmarks_cached_greedy_equals_recompute_without_a_deprecated_kwarg(model):
    """benchmarks/robustness/weights_check_ties.py's KV-cache greedy: the forward's cache argument is
    `cache` from transformers 5.25 (`past_key_values` warns there) and `past_key_values` before."""
    from benchmarks.robustness.weights_check_ties import cached_greedy, recompute_greedy

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cached = cached_greedy(model, PROMPT, 8)
    assert cached == recompute_greedy(model, PROMPT, 8) == greedy(model, PROMPT, 8)


def test_an_actor_on_packed_varlen_attention_scores_as_sdpa_does(model, tiny_llama_dir):
    """The H100 recipe's actor ran `tandem_varlen` attention (trainer/varlen.py), which needs the packed
    row's sample boundaries: the scoring forward gives them (it raised ValueError before)."""
    from tandemrl.trainer.varlen import VARLEN_ATTN, register_varlen_attention

    register_varlen_attention()
    varlen = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation=VARLEN_ATTN
    ).eval()
    engine = greedy(model, PROMPT, 6)
    engine[2] = 7  # off the argmax, so a gap is scored too
    argmax, gaps = argmax_gaps(varlen, PROMPT, engine)
    want_argmax, want_gaps = argmax_gaps(model, PROMPT, engine)
    assert argmax == want_argmax and gaps[2] > 0
    assert gaps == pytest.approx(want_gaps, abs=1e-4)


def test_a_bf16_model_is_scored_with_fp32_logits(tiny_llama_dir):
    """bf16 logits are rounded to steps of 2^-8 of their size; the gaps come from an fp32 head instead."""
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    engine = [5, 9, 13, 17]
    _, gaps = argmax_gaps(bf16, PROMPT, engine)
    with torch.no_grad():
        ids = torch.tensor([PROMPT + engine[:-1]])
        hidden = bf16.base_model(input_ids=ids).last_hidden_state[0, len(PROMPT) - 1 :]
        exact = torch.log_softmax(hidden.float() @ bf16.get_output_embeddings().weight.float().T, dim=-1)
        rounded = torch.log_softmax(bf16(ids).logits[0, len(PROMPT) - 1 :].float(), dim=-1)
    taken = torch.tensor(engine)[:, None]
    want = (exact.max(dim=-1).values - exact.gather(1, taken)[:, 0]).tolist()
    coarse = (rounded.max(dim=-1).values - rounded.gather(1, taken)[:, 0]).tolist()
    assert gaps == pytest.approx(want, abs=1e-5)
    assert gaps != pytest.approx(coarse, abs=1e-5)  # the bf16 forward's own logits would read otherwise
