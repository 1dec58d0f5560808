"""Off-policy corrections through a real actor step on CPU (tiny random Llama, 1-rank gloo group): the
proximal logprobs are recomputed, the logged weight mean and clip fraction are the ones the rollout
logprobs imply, on-policy data trains exactly like plain PPO, and capped weights reach the gradient."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.trainer.actor import Actor
from tandemrl.trainer.batching import TrainSample
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples

TARGET_WEIGHTS = (0.5, 1.5, 3.0)  # pi_prox / pi_behav per token, in turn; 3.0 is over the cap 2.0
CAPS = ("algorithm.tis_cap=2.0", "algorithm.decoupled_weight_cap=2.0")


def _actor(model_dir, *overrides: str) -> Actor:
    torch.set_num_threads(1)
    return Actor(cpu_actor_setup(model_dir, "actor.optim.lr=0.001", "algorithm.n_minibatches=1", *overrides))


def _rollout_logprobs_at(actor: Actor, samples: list[TrainSample], weights) -> list[TrainSample]:
    """The samples with rollout logprobs set so that token t's weight to the actor's current policy
    is weights[t % len(weights)]; a weight of 1 everywhere makes the data exactly on-policy."""
    own = actor.compute_logprobs(samples)
    return [
        TrainSample(
            s.input_ids,
            s.loss_mask,
            [
                (lp - math.log(weights[t % len(weights)])) * m
                for t, (lp, m) in enumerate(zip(lp_s, s.loss_mask, strict=True))
            ],
            s.advantage,
        )
        for s, lp_s in zip(samples, own, strict=True)
    ]


def _expected(samples: list[TrainSample], applied) -> tuple[float, float]:
    tokens = [t for s in samples for t in range(1, s.num_tokens) if s.loss_mask[t]]
    mean = sum(applied[t % len(applied)] for t in tokens) / len(tokens)
    capped = sum(TARGET_WEIGHTS[t % len(TARGET_WEIGHTS)] > 2.0 for t in tokens) / len(tokens)
    return mean, capped


@pytest.mark.parametrize("correction, applied", [("tis", (0.5, 1.5, 2.0)), ("decoupled", (0.5, 1.5, 0.0))])
def test_logged_weights_are_those_the_rollout_logprobs_imply(tiny_llama_dir, correction, applied):
    actor = _actor(tiny_llama_dir, f"algorithm.off_policy_correction={correction}", *CAPS)
    assert actor.setup.algorithm.recompute_logprobs is True  # derived from the correction
    samples = _rollout_logprobs_at(actor, make_samples(seed=1, num_samples=6), TARGET_WEIGHTS)
    metrics = actor.train_step(samples)
    mean, capped = _expected(samples, applied)
    assert metrics["train/actor/is_weight_mean"] == pytest.approx(mean, abs=1e-4)
    assert metrics["train/actor/is_clip_fraction"] == pytest.approx(capped, abs=1e-9)
    assert 0.0 < capped < 1.0
    # the ratio is taken to the recomputed proximal policy: exactly 1 before the only update
    assert metrics["train/actor/ratio_abs"] < 1e-6


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_on_policy_data_trains_exactly_like_plain_ppo(tiny_llama_dir, correction):
    plain = _actor(
        tiny_llama_dir, "algorithm.off_policy_correction=none", "algorithm.recompute_logprobs=true"
    )
    corrected = _actor(tiny_llama_dir, f"algorithm.off_policy_correction={correction}")
    samples = _rollout_logprobs_at(plain, make_samples(seed=2, num_samples=6), (1.0,))
    m_plain, m_corrected = plain.train_step(samples), corrected.train_step(samples)
    assert "train/actor/is_weight_mean" not in m_plain
    assert m_corrected["train/actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m_corrected["train/actor/is_clip_fraction"] == 0.0
    assert m_corrected["train/actor/loss"] == pytest.approx(m_plain["train/actor/loss"], abs=1e-6)
    after_plain, after_corrected = dict(plain.iter_full_weights()), dict(corrected.iter_full_weights())
    assert max((after_plain[k] - after_corrected[k]).abs().max().item() for k in after_plain) < 1e-6


def test_stale_data_over_the_cap_is_truncated_by_tis_and_dropped_by_decoupled(tiny_llama_dir):
    """Every token at weight 20, over both default caps (tis 2, decoupled 5): TIS doubles PPO's gradient
    (every weight is truncated to 2), decoupled PPO drops every token."""
    norms, samples = {}, None
    for correction in ("none", "tis", "decoupled"):
        actor = _actor(
            tiny_llama_dir,
            f"algorithm.off_policy_correction={correction}",
            "algorithm.recompute_logprobs=true",
        )
        samples = samples or _rollout_logprobs_at(actor, make_samples(seed=3, num_samples=6), (20.0,))
        before = {k: v.clone() for k, v in actor.iter_full_weights()}
        metrics = actor.train_step(samples)
        norms[correction] = metrics["train/actor/grad_norm"]
        if correction != "none":
            assert metrics["train/actor/is_clip_fraction"] == 1.0
    assert norms["none"] > 0
    assert norms["tis"] == pytest.approx(2.0 * norms["none"], rel=1e-5)
    assert norms["decoupled"] == 0.0
    after = dict(actor.iter_full_weights())  # the decoupled actor: no token left, so no change
    assert max((before[k] - after[k]).abs().max().item() for k in before) == 0.0


def test_current_proximal_matches_recompute_on_one_minibatch_without_the_extra_pass(tiny_llama_dir):
    """With one minibatch the step's only forward is at the weights before the update, so the current
    forward, detached, is the recomputed proximal policy: same logged weights, same update, no clip."""
    overrides = ("algorithm.off_policy_correction=tis", *CAPS)
    recomputed = _actor(tiny_llama_dir, *overrides)
    current = _actor(tiny_llama_dir, *overrides, "algorithm.proximal_logprobs=current")
    assert current.setup.algorithm.recompute_logprobs is False  # derived: no extra pass
    samples = _rollout_logprobs_at(recomputed, make_samples(seed=4, num_samples=6), TARGET_WEIGHTS)
    m_recomputed, m_current = recomputed.train_step(samples), current.train_step(samples)
    mean, capped = _expected(samples, (0.5, 1.5, 2.0))
    assert m_current["train/actor/is_weight_mean"] == pytest.approx(mean, abs=1e-4)
    assert m_current["train/actor/is_clip_fraction"] == pytest.approx(capped, abs=1e-9)
    assert m_current["train/actor/ratio_abs"] == 0.0 and m_current["train/actor/clip_fraction"] == 0.0
    # the gap to the rollout is measured against the rollout's logprobs in both
    gap = m_current["train/actor/rollout_train_logprob_gap"]
    assert gap == pytest.approx(m_recomputed["train/actor/rollout_train_logprob_gap"], rel=1e-4) and gap > 0.1
    after_r, after_c = dict(recomputed.iter_full_weights()), dict(current.iter_full_weights())
    assert max((after_r[k] - after_c[k]).abs().max().item() for k in after_r) < 1e-6
    assert max((after_r[k] - w).abs().max().item() for k, w in _actor(tiny_llama_dir).iter_full_weights()) > 0


def test_current_proximal_follows_the_weights_across_minibatches(tiny_llama_dir):
    """With two minibatches the second one's weight is taken at the weights the first update left, so the
    update differs from the recomputed proximal policy's (which stays at the step's start)."""
    overrides = ("algorithm.off_policy_correction=tis", "algorithm.n_minibatches=2", *CAPS)
    recomputed = _actor(tiny_llama_dir, *overrides)
    current = _actor(tiny_llama_dir, *overrides, "algorithm.proximal_logprobs=current")
    samples = _rollout_logprobs_at(recomputed, make_samples(seed=5, num_samples=6), (1.5,))
    m_recomputed, m_current = recomputed.train_step(samples), current.train_step(samples)
    assert m_recomputed["train/actor/ratio_abs"] > 0 and m_current["train/actor/ratio_abs"] == 0.0
    after_r, after_c = dict(recomputed.iter_full_weights()), dict(current.iter_full_weights())
    assert max((after_r[k] - after_c[k]).abs().max().item() for k in after_r) > 1e-7


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_recompute_on_the_device_equals_proximal_logprobs_computed_up_front(tiny_llama_dir, correction):
    """The step recomputes the proximal logprobs of minibatches 2..n into their micro-batches on the device
    and takes the first minibatch's from its own forward. The reference is handed proximal logprobs
    computed up front over all samples and recomputes nothing: the same update, ratios and weights
    follow (three minibatches and a large lr, so the later minibatches' ratios are not 1)."""
    overrides = (f"algorithm.off_policy_correction={correction}", "algorithm.n_minibatches=3", *CAPS)
    actor, reference = _actor(tiny_llama_dir, *overrides), _actor(tiny_llama_dir, *overrides)
    reference.recomputes = False  # white box: old_logprobs as handed over, as before the step
    samples = _rollout_logprobs_at(actor, make_samples(seed=6, num_samples=9), TARGET_WEIGHTS)
    proximal = reference.compute_logprobs(samples)
    handed = [
        TrainSample(s.input_ids, s.loss_mask, lp, s.advantage, s.old_logprobs)
        for s, lp in zip(samples, proximal, strict=True)
    ]
    m_actor, m_reference = actor.train_step(samples), reference.train_step(handed)
    for key in ("loss", "ratio_abs", "clip_fraction", "is_weight_mean", "is_clip_fraction", "entropy"):
        assert m_actor[f"train/actor/{key}"] == pytest.approx(
            m_reference[f"train/actor/{key}"], rel=1e-4, abs=1e-7
        )
    assert m_actor["train/actor/ratio_abs"] > 1e-4  # the later minibatches moved off the proximal policy
    after_a, after_r = dict(actor.iter_full_weights()), dict(reference.iter_full_weights())
    start = dict(_actor(tiny_llama_dir).iter_full_weights())
    update = sum((after_r[k] - start[k]).pow(2).sum() for k in start).sqrt()
    gap_norm = sum((after_a[k] - after_r[k]).pow(2).sum() for k in start).sqrt()
    # the same update up to fp32 summation order, which the micro-batch shapes and the CPU's kernels set
    # (AVX-512/AMX gave a largest weight gap of 2.6e-6 where an AVX2 box gave < 1e-6); handing the rollout's
    # logprobs as the proximal ones instead moves the weights 6e-3 apart, an update being 3e-3
    print(f"{correction}: weights apart {gap_norm / update:.1e} of the update's norm")
    assert gap_norm < 1e-4 * update
    # the gap to the rollout's logprobs, over every loss token of the step
    tokens = [(s, t) for s in samples for t in range(1, s.num_tokens) if s.loss_mask[t]]
    by_id = {id(s): lp for s, lp in zip(samples, proximal, strict=True)}
    gap = sum(abs(by_id[id(s)][t] - s.old_logprobs[t]) for s, t in tokens) / len(tokens)
    assert m_actor["train/actor/rollout_train_logprob_gap"] == pytest.approx(gap, rel=1e-4)


def _with_lags(samples: list[TrainSample], lag: int) -> list[TrainSample]:
    return [
        TrainSample(
            s.input_ids, s.loss_mask, s.old_logprobs, s.advantage, lags=[lag * m for m in s.loss_mask]
        )
        for s in samples
    ]


def test_loglinear_proximal_equals_recompute_on_fresh_data_without_the_extra_pass(
    tiny_llama_dir, monkeypatch
):
    """Tokens sampled by the step's starting weights (lag 0, on-policy): the recomputed proximal logprobs of
    the second minibatch are the rollout's, and so are the loglinear ones; the same update, no extra pass."""
    overrides = ("algorithm.off_policy_correction=decoupled", "algorithm.n_minibatches=2")
    recomputed = _actor(tiny_llama_dir, *overrides)
    loglinear = _actor(tiny_llama_dir, *overrides, "algorithm.proximal_logprobs=loglinear")
    assert loglinear.setup.algorithm.recompute_logprobs is False  # derived: no extra pass

    def no_pass(*args):
        raise AssertionError("loglinear ran the proximal pass")

    monkeypatch.setattr(loglinear, "_recompute_proximal", no_pass)
    samples = _with_lags(_rollout_logprobs_at(recomputed, make_samples(seed=6, num_samples=6), (1.0,)), 0)
    m_recomputed, m_loglinear = recomputed.train_step(samples), loglinear.train_step(samples)
    assert m_recomputed["train/actor/ratio_abs"] > 0  # the second minibatch moved off its proximal policy
    assert m_loglinear["train/actor/ratio_abs"] == pytest.approx(
        m_recomputed["train/actor/ratio_abs"], rel=1e-3
    )
    after_r, after_l = dict(recomputed.iter_full_weights()), dict(loglinear.iter_full_weights())
    assert max((after_r[k] - after_l[k]).abs().max().item() for k in after_r) < 1e-6


def test_loglinear_proximal_leans_stale_tokens_towards_the_current_forward(tiny_llama_dir):
    """The same rollout logprobs, one version stale: the second minibatch's proximal logprobs move halfway to
    its own forward, so its ratios and its update differ from the fresh case's."""
    overrides = (
        "algorithm.off_policy_correction=decoupled",
        "algorithm.n_minibatches=2",
        "algorithm.proximal_logprobs=loglinear",
    )
    fresh, stale = _actor(tiny_llama_dir, *overrides), _actor(tiny_llama_dir, *overrides)
    samples = _rollout_logprobs_at(fresh, make_samples(seed=7, num_samples=6), (1.0,))
    m_fresh, m_stale = fresh.train_step(_with_lags(samples, 0)), stale.train_step(_with_lags(samples, 1))
    # halfway from the rollout's to the current forward: the ratio to the proximal policy halves
    assert m_stale["train/actor/ratio_abs"] == pytest.approx(m_fresh["train/actor/ratio_abs"] / 2, rel=0.05)
    after_f, after_s = dict(fresh.iter_full_weights()), dict(stale.iter_full_weights())
    assert max((after_f[k] - after_s[k]).abs().max().item() for k in after_f) > 1e-8
    assert all(torch.isfinite(w).all() for w in after_s.values())
