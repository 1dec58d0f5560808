"""The actor's chunked logprob/entropy head (`policy.chunked_logprobs`, a custom autograd function that
recomputes each chunk's logits in backward) against the plain eager log_softmax: values, entropies and
gradients of hidden states, weight and bias, in fp32 and with bf16 matmuls over fp32 weights (the
single-rank autocast path the actor runs on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tandemrl.trainer.policy import chunked_logprobs


def _inputs(seed: int = 0, rows: int = 37, hidden: int = 16, vocab: int = 300):
    gen = torch.Generator().manual_seed(seed)
    hidden_KH = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * 0.5).requires_grad_(True)
    bias_V = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_(True)
    labels_K = torch.randint(0, vocab, (rows,), generator=gen)
    grad_K = torch.randn(rows, generator=gen)
    return hidden_KH, weight_VH, bias_V, labels_K, grad_K


def _reference(hidden_KH, weight_VH, bias_V, labels_K, temperature):
    logp_KV = torch.log_softmax((hidden_KH @ weight_VH.T + bias_V).double() / temperature, -1)
    entropy_K = -(logp_KV.exp() * logp_KV).sum(-1)
    return logp_KV.gather(-1, labels_K[:, None])[:, 0], entropy_K


def _grads(logprobs_K, grad_K, tensors):
    return torch.autograd.grad((logprobs_K * grad_K).sum(), tensors)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_eager_fp32(temperature):
    h, w, b, labels, grad_K = _inputs()
    logprobs, entropy = chunked_logprobs(h, w, b, labels, temperature, with_entropy=True, chunk_tokens=8)
    ref_logprobs, ref_entropy = _reference(h, w, b, labels, temperature)
    assert logprobs.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad  # a metric: no gradient flows through it
    got_grads, ref_grads = _grads(logprobs, grad_K, (h, w, b)), _grads(ref_logprobs, grad_K, (h, w, b))
    for got, want in zip(got_grads, ref_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_without_entropy_returns_zeros_and_same_values():
    h, w, b, labels, _ = _inputs(seed=1)
    with torch.no_grad():
        plain, zeros = chunked_logprobs(h, w, b, labels, chunk_tokens=5)
        with_entropy, _ = chunked_logprobs(h, w, b, labels, with_entropy=True, chunk_tokens=64)
    assert torch.equal(zeros, torch.zeros_like(zeros))
    torch.testing.assert_close(plain, with_entropy, atol=1e-6, rtol=0)


def test_bf16_compute_over_fp32_weights_is_close_and_grads_stay_fp32():
    """What autocast gives the head on the single-rank GPU path: bf16 matmuls, fp32 logits and grads."""
    h, w, b, labels, grad_K = _inputs(seed=2)
    logprobs, entropy = chunked_logprobs(
        h, w, b, labels, with_entropy=True, chunk_tokens=16, compute_dtype=torch.bfloat16
    )
    ref_logprobs, ref_entropy = _reference(h, w, b, labels, 1.0)
    assert logprobs.dtype == torch.float32
    assert (logprobs.double() - ref_logprobs).abs().max() < 0.1
    assert (entropy.double() - ref_entropy).abs().max() < 0.05
    got = _grads(logprobs, grad_K, (h, w, b))
    want = _grads(ref_logprobs, grad_K, (h, w, b))
    for g, r in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        g, r = g.double().flatten(), r.double().flatten()
        cosine = float(g @ r / (g.norm() * r.norm()))
        assert cosine > 0.99, cosine
