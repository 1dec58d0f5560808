"""Actor train steps on CPU (1-rank gloo group, tiny Llama): the gradient is the token-mean over the
minibatch whatever the micro-batch budget; gradient checkpointing changes nothing; the KL to the
reference starts at 0; metrics are the documented ones."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tandemrl.trainer.actor import Actor
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples

METRICS = (
    "loss",
    "ratio_abs",
    "clip_fraction",
    "approx_kl",
    "entropy",
    "grad_norm",
    "lr",
    "rollout_train_logprob_gap",
    "clipped_pos_advantage_share",
)


def _run(model_dir, *overrides: str, num_steps: int = 1):
    torch.set_num_threads(1)
    actor = Actor(
        cpu_actor_setup(model_dir, "actor.optim.lr=0.001", "algorithm.recompute_logprobs=true", *overrides)
    )
    metrics = [actor.train_step(make_samples(seed=s, num_samples=6)) for s in range(num_steps)]
    return actor, metrics, {n: t.clone() for n, t in actor.iter_full_weights()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_micro_batch_budget_does_not_change_the_update(tiny_llama_dir):
    _, m_small, w_small = _run(tiny_llama_dir, "actor.micro_batch_tokens=40", "algorithm.n_minibatches=2")
    _, m_big, w_big = _run(tiny_llama_dir, "actor.micro_batch_tokens=4096", "algorithm.n_minibatches=2")
    # Adam divides by sqrt(v): float rounding of near-zero gradient entries shows up at ~1e-6
    assert _max_diff(w_small, w_big) < 1e-5
    assert m_small[0]["train/actor/loss"] == pytest.approx(m_big[0]["train/actor/loss"], abs=1e-6)
    assert m_small[0]["train/actor/grad_norm"] == pytest.approx(m_big[0]["train/actor/grad_norm"], rel=1e-5)
    assert set(f"train/actor/{k}" for k in METRICS) <= set(m_small[0])
    assert m_small[0]["train/actor/num_updates"] == 2.0


def test_gradient_checkpointing_gives_the_same_step(tiny_llama_dir):
    _, _, plain = _run(tiny_llama_dir, "algorithm.n_minibatches=1")
    actor, _, checkpointed = _run(
        tiny_llama_dir, "algorithm.n_minibatches=1", "actor.gradient_checkpointing=true"
    )
    assert any(getattr(m, "gradient_checkpointing", False) for m in actor.hf_model.modules())
    assert _max_diff(plain, checkpointed) < 1e-5


def _minibatch_grads(actor: Actor, samples) -> dict[str, torch.Tensor]:
    """Gradients of one minibatch's token-mean PPO loss, accumulated over the actor's own micro-batches."""
    num_tokens = sum(s.num_loss_tokens for s in samples)
    for micro in actor._plan(samples):
        actor._ppo_micro_step(
            micro.to(actor.device),
            num_tokens,
            defaultdict(float),
            is_first=False,
            is_own_proximal=actor.is_proximal_current,
        )
    return {n: p.grad.clone() for n, p in actor.hf_model.named_parameters()}


def _assert_same_update(reference: Actor, other: Actor, samples, rel: float, keys: tuple, abs_tol: float):
    """`other` computes `reference`'s minibatch gradients (within `rel` of their largest entry) and the
    same step metrics `keys` (within `rel` / `abs_tol`)."""
    g_reference, g_other = _minibatch_grads(reference, samples), _minibatch_grads(other, samples)
    scale = max(g.abs().max().item() for g in g_reference.values())
    assert _max_diff(g_reference, g_other) < rel * scale
    reference.optimizer.zero_grad(set_to_none=True)
    other.optimizer.zero_grad(set_to_none=True)
    m_reference, m_other = reference.train_step(samples), other.train_step(samples)
    for key in keys:
        assert m_other[f"train/actor/{key}"] == pytest.approx(
            m_reference[f"train/actor/{key}"], rel=rel, abs=abs_tol
        )


def test_varlen_packed_rows_give_the_loss_and_grads_of_padded_sdpa(tiny_llama_dir):
    """The packed varlen path (one row per micro-batch, per-sample attention; on CPU its sdpa
    reference) gives the gradient and the step metrics of the padded-rows sdpa path."""
    torch.set_num_threads(1)
    samples = make_samples(seed=3, num_samples=6)
    padded = Actor(cpu_actor_setup(tiny_llama_dir, "actor.micro_batch_tokens=64"))
    varlen = Actor(
        cpu_actor_setup(tiny_llama_dir, "actor.micro_batch_tokens=64", "actor.attn_implementation=varlen")
    )
    assert padded.is_padded and not varlen.is_padded
    assert len(varlen._plan(samples)) < len(padded._plan(samples))  # packing: fewer forwards
    _assert_same_update(padded, varlen, samples, 1e-5, ("loss", "entropy", "grad_norm", "approx_kl"), 1e-7)


def test_fused_rms_norm_gives_the_loss_and_grads_of_hf_norms(tiny_llama_dir):
    """actor.fused_rms_norm routes every decoder norm through F.rms_norm; the gradient
    and the step metrics are those of HF's own norm."""
    torch.set_num_threads(1)
    samples = make_samples(seed=5, num_samples=6)
    plain = Actor(cpu_actor_setup(tiny_llama_dir, "actor.fused_rms_norm=false"))
    fused = Actor(cpu_actor_setup(tiny_llama_dir, "actor.fused_rms_norm=true"))
    norms = [m for m in fused.hf_model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5 and all("forward" in vars(m) for m in norms)  # 2 per layer + the final one
    assert not any("forward" in vars(m) for m in plain.hf_model.modules())
    _assert_same_update(plain, fused, samples, 1e-6, ("loss", "entropy", "grad_norm"), 1e-8)


@pytest.mark.slow
def test_compiled_layers_give_the_same_step(tiny_llama_dir):
    """actor.compile_layers (inductor on CPU here) changes speed, not the update."""
    _, m_plain, plain = _run(tiny_llama_dir, "algorithm.n_minibatches=1")
    actor, m_compiled, compiled = _run(
        tiny_llama_dir, "algorithm.n_minibatches=1", "actor.compile_layers=true"
    )
    assert all(layer._compiled_call_impl is not None for layer in actor.hf_model.model.layers)
    assert m_compiled[0]["train/actor/loss"] == pytest.approx(m_plain[0]["train/actor/loss"], abs=1e-5)
    assert _max_diff(plain, compiled) < 1e-4


def test_warm_up_leaves_the_update_as_it_was(tiny_llama_dir):
    """Actor.warm_up runs the step's forward and backward on made-up data, then drops it all: the next
    train step, the weights after it and the RNG are bit for bit those of an actor that never warmed up."""
    torch.set_num_threads(1)
    # a 2,048-token budget: the warm-up's largest rows (the budget's) stay quick on the CPU
    overrides = ("actor.optim.lr=0.001", "algorithm.recompute_logprobs=true", "actor.micro_batch_tokens=2048")
    samples = make_samples(seed=3, num_samples=6)
    cold, warm = (
        Actor(cpu_actor_setup(tiny_llama_dir, *overrides)),
        Actor(cpu_actor_setup(tiny_llama_dir, *overrides)),
    )
    rng_before = torch.get_rng_state()
    warm.warm_up()
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(p.grad is None for p in warm.policy.parameters())
    assert (warm.num_updates, warm.weight_version, len(warm.optimizer.state)) == (0, 0, 0)
    m_cold, m_warm = cold.train_step(samples), warm.train_step(samples)
    for key in ("loss", "entropy", "grad_norm", "lr", "rollout_train_logprob_gap"):
        assert m_warm[f"train/actor/{key}"] == m_cold[f"train/actor/{key}"], key
    weights_cold = dict(cold.iter_full_weights())
    assert all(torch.equal(t, weights_cold[n]) for n, t in warm.iter_full_weights())


def test_compiled_actor_is_traced_at_build_not_in_its_first_step(tiny_llama_dir, monkeypatch):
    """With actor.compile_layers the actor warms up as it is built: Dynamo traces the layers' graphs then
    (the train step's and the no-grad recompute's), and the first train step traces nothing new. Dynamo's
    eager backend here, so only Dynamo's own guards are tried; the size guards Inductor adds to its fusions
    show only under Inductor on a GPU (benchmarks/actor/first_step.py, first_step_h100_735798f.json)."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager", **kw)
    )
    torch._dynamo.reset()
    counters.clear()
    actor = Actor(
        cpu_actor_setup(
            tiny_llama_dir,
            "actor.compile_layers=true",
            "actor.micro_batch_tokens=2048",
            "algorithm.recompute_logprobs=true",
            "algorithm.n_minibatches=2",
        )
    )
    traced_at_build = counters["stats"]["unique_graphs"]
    assert traced_at_build >= 2  # the grad and no-grad forwards at least
    metrics = actor.train_step(make_samples(seed=4, num_samples=8))
    assert counters["stats"]["unique_graphs"] == traced_at_build
    assert metrics["train/actor/num_updates"] == 2.0
    torch._dynamo.reset()


def test_kl_to_reference_starts_at_zero_then_grows(tiny_llama_dir):
    actor, metrics, _ = _run(
        tiny_llama_dir,
        "algorithm.kl_coef=0.1",
        "algorithm.n_minibatches=1",
        "actor.optim.lr=0.01",
        num_steps=2,
    )
    assert actor.ref_policy is not None
    assert metrics[0]["train/actor/kl_ref"] < 1e-9  # policy == reference before the first update
    assert metrics[1]["train/actor/kl_ref"] > 1e-4


def test_recomputed_logprobs_start_the_step_at_ratio_one(tiny_llama_dir):
    _, metrics, _ = _run(tiny_llama_dir, "algorithm.n_minibatches=1")
    # old logprobs = the current policy's, one minibatch: every ratio is exactly 1 before the update
    assert metrics[0]["train/actor/ratio_abs"] < 1e-6
    assert metrics[0]["train/actor/clip_fraction"] == 0.0
    # the sample helpers' rollout logprobs are random, so the measured gap is large
    assert metrics[0]["train/actor/rollout_train_logprob_gap"] > 0.1


def test_empty_step_is_a_clear_error(tiny_llama_dir):
    actor = Actor(cpu_actor_setup(tiny_llama_dir))
    with pytest.raises(ValueError, match="no samples"):
        actor.train_step([])
