"""The CUDA runner's sync-free sampler (`cuda_graphs.sample_untruncated`), checked on CPU: greedy rows
pick the argmax with the T = 1 logprob, sampled rows follow softmax(logits / T) (chi-square), mixed
batches keep each row's mode, as the reference sampler does."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from tandemrl.engine.cuda_graphs import sample_untruncated
from tandemrl.engine.sampler import sample


def _generator(seed: int = 0) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def test_greedy_matches_reference_sampler():
    logits = torch.randn(8, 50, generator=_generator(1))
    ids, logprobs = sample_untruncated(logits, 0.0, _generator())
    ref_ids, ref_logprobs = sample(logits, torch.zeros(8), torch.ones(8), torch.full((8,), -1))
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs)


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature in (1.0, 0.7):
        rows = logits.expand(20000, -1)
        ids, logprobs = sample_untruncated(rows, temperature, _generator(2))
        probs = torch.softmax(logits.double() / temperature, -1)
        counts = torch.bincount(ids, minlength=6).double()
        assert chisquare(counts.numpy(), (probs * 20000).numpy()).pvalue > 1e-3
        torch.testing.assert_close(logprobs, probs.log()[ids].float())


def test_mixed_batch_keeps_each_rows_mode():
    logits = torch.randn(6, 30, generator=_generator(3))
    temps = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    ids, logprobs = sample_untruncated(logits, temps, _generator(4))
    greedy = temps == 0
    assert ids[greedy].tolist() == logits[greedy].argmax(-1).tolist()
    expected = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], -1)
    torch.testing.assert_close(logprobs, expected.gather(-1, ids[:, None]).squeeze(-1))
