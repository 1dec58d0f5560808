"""Batched sampling: greedy, temperature, top-k, top-p, with the logprob of each chosen token.

Logprob convention (documented in the README of the engine): a sampled token's logprob is taken
under the distribution it was actually drawn from, i.e. softmax(logits / T) restricted to the
top-k / top-p set and renormalised. With T = 1 and no truncation that is exactly the model's
log_softmax, the policy logprob the trainer needs. Greedy tokens (T = 0) report the model's
log_softmax at T = 1, since the point mass they are "drawn" from carries no information.
Top-k/top-p follow SGLang: top-p keeps a token while the probability mass ranked before it is <= top_p.
"""

from __future__ import annotations

import torch

_CANDIDATES = 1024  # top-p/top-k look at this many candidates first and fall back to a full sort


def draw(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row, drawn from (unnormalised) probs by inverting the CDF (much faster than
    torch.multinomial on CPU for large vocabularies)."""
    cdf = probs_BV.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(probs_BV.shape[0], 1, generator=generator, device=probs_BV.device) * total
    # u < total strictly, so the first cdf entry above u exists and has positive mass (zeros never win).
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def _kept(
    probs_BV: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probs restricted to top-k / top-p and renormalised, over candidates sorted by probability; returns
    (kept probs, their token ids)."""
    vocab = probs_BV.shape[-1]
    k_limits = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, vocab))
    num = min(vocab, max(_CANDIDATES, int(k_limits.max())))
    vals, idx = probs_BV.topk(num, dim=-1)  # sorted, descending
    # Exact only if every row's nucleus (or top-k set) lies within the candidates; otherwise sort all.
    covered = (k_limits <= num) | (vals.sum(-1) > top_ps)
    if num < vocab and not bool(covered.all()):
        vals, idx = probs_BV.sort(dim=-1, descending=True)
        num = vocab
    mass_before = torch.cumsum(vals, dim=-1) - vals
    rank = torch.arange(num, device=probs_BV.device)[None, :]
    keep = (rank < k_limits[:, None]) & (mass_before <= top_ps[:, None])
    kept = torch.where(keep, vals, torch.zeros_like(vals))
    return kept / kept.sum(-1, keepdim=True), idx


def _truncated_sample(
    probs_BV: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from probs restricted to top-k / top-p; returns (token ids, logprobs under the kept set)."""
    kept, idx = _kept(probs_BV, top_ps, top_ks)
    choice = draw(kept, generator)[:, None]  # [B, 1] index into candidates
    token_ids = idx.gather(-1, choice).squeeze(-1)
    logprobs = kept.gather(-1, choice).squeeze(-1).log()
    return token_ids, logprobs


def target_probs(
    logits_RV: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor
) -> torch.Tensor:
    """Each row's whole distribution as `sample` draws from it (greedy rows: softmax at T = 1, whose
    argmax `sample` picks): the probabilities of speculative verification (`speculative.verify`)."""
    logits_RV = logits_RV.float()
    temps = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits_RV / temps[:, None], dim=-1)
    truncated = (temperatures != 0) & ((top_ps < 1) | (top_ks > 0))
    if bool(truncated.any()):
        rows = truncated.nonzero().squeeze(-1)
        kept, idx = _kept(probs[rows], top_ps[rows], top_ks[rows])
        probs[rows] = torch.zeros_like(probs[rows]).scatter(-1, idx, kept)
    return probs


def sample(
    logits_BV: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (token_ids [B], logprobs [B]) as described in the module doc."""
    logits_BV = logits_BV.float()
    token_ids = torch.empty(logits_BV.shape[0], dtype=torch.long, device=logits_BV.device)
    logprobs = torch.empty(logits_BV.shape[0], dtype=torch.float32, device=logits_BV.device)
    greedy = temperatures == 0
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(-1)
        raw = torch.log_softmax(logits_BV[rows], dim=-1)
        chosen = raw.argmax(-1)
        token_ids[rows], logprobs[rows] = chosen, raw.gather(-1, chosen[:, None]).squeeze(-1)
    truncated = ~greedy & ((top_ps < 1) | (top_ks > 0))
    plain = ~greedy & ~truncated
    if bool(plain.any()):
        rows = plain.nonzero().squeeze(-1)
        probs = torch.softmax(logits_BV[rows] / temperatures[rows, None], dim=-1)
        chosen = draw(probs, generator)
        token_ids[rows], logprobs[rows] = chosen, probs.gather(-1, chosen[:, None]).squeeze(-1).log()
    if bool(truncated.any()):
        rows = truncated.nonzero().squeeze(-1)
        probs = torch.softmax(logits_BV[rows] / temperatures[rows, None], dim=-1)
        token_ids[rows], logprobs[rows] = _truncated_sample(probs, top_ps[rows], top_ks[rows], generator)
    return token_ids, logprobs
