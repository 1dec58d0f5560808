"""The actor's own head path (trainer/policy.py `chunked_logprobs` from the last hidden state, and
trainer/greedy_gaps.py) against HF's full forward for models whose forward scales the logits: Cohere's
`logit_scale` multiplies them, Granite's `logits_scaling` divides them. A model with a final soft cap
(Gemma 2) is refused by name, since the chunked head applies no tanh. Tiny random models, no download."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandemrl.trainer.greedy_gaps import argmax_gaps
from tandemrl.trainer.policy import PolicyModel, head_logit_scale

TINY = dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
SCALED = {"cohere": {"logit_scale": 0.25}, "granite": {"logits_scaling": 4.0}}


def tiny(model_type: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY, **extra})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", sorted(SCALED))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_actors_logprobs_are_the_scaled_forwards(model_type, temperature):
    model = tiny(model_type, **SCALED[model_type])
    assert head_logit_scale(model.config) == 0.25
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (1, 12), generator=gen)
    labels = torch.randint(0, 300, (12,), generator=gen)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].double() / temperature, -1)
        ours, _ = PolicyModel(model, temperature)(ids, torch.arange(12)[None], None, labels, torch.arange(12))
    torch.testing.assert_close(ours.double(), ref.gather(1, labels[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    # without the scale the logprobs are another distribution's: the test above can fail
    unscaled = torch.log_softmax((model(ids).logits[0].double() / 0.25) / temperature, -1)
    assert (unscaled.gather(1, labels[:, None])[:, 0] - ours.double()).abs().max() > 0.05


@pytest.mark.parametrize("model_type", sorted(SCALED))
def test_greedy_gaps_score_with_the_scaled_logits(model_type):
    model = tiny(model_type, **SCALED[model_type])
    prompt, continuation = [5, 17, 42, 7], [99, 3, 250, 11]
    top, gaps = argmax_gaps(model, prompt, continuation)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0, len(prompt) - 1 :].double()
    logprobs = torch.log_softmax(logits, -1)
    want = logprobs.max(-1).values - logprobs.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    assert top == logprobs.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(gaps, dtype=torch.float64), want.clamp(min=0), atol=1e-5, rtol=1e-5
    )


def test_a_final_soft_cap_is_refused_by_name():
    model = tiny("gemma2", head_dim=8, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"gemma2: final_logit_softcapping=30.0 .* chunked logprob head"):
        PolicyModel(model)
    assert head_logit_scale(tiny("llama").config) == 1.0  # the models that train today: no factor


def test_train_refuses_a_soft_capped_model_before_any_service(tmp_path):
    """`tandem train` (and `config show --check`) read the model's config.json: the refusal names the key
    and the model, before a server starts."""
    from tandemrl.commands.preflight import check_before_services
    from tandemrl.config.errors import ConfigError
    from tandemrl.config.loader import load_config

    capped = tiny("gemma2", head_dim=8, final_logit_softcapping=30.0, max_position_embeddings=8192)
    capped.config.save_pretrained(tmp_path / "gemma2")
    config = load_config(
        None,
        [
            f"rollout.model.model_path={tmp_path / 'gemma2'}",
            "retrieval.launch=false",
            f"runner.output_dir={tmp_path}/run",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"gemma2'.* final_logit_softcapping=30.0\), and the actor's chunked"
    ):
        check_before_services(config)
