"""Speculative decoding without a draft model: n-gram (prompt-lookup) drafts and their exact verification.

Drafting (`NgramDrafter`): a request's last n tokens (n from `spec_ngram_max` down to `spec_ngram_min`)
are looked up in its own context (prompt, tool and information blocks, output so far); the tokens that
followed their most recent earlier occurrence are the draft. Search-R1 trajectories copy a lot: the query
copies the question, the answer copies a passage. The lookup is an index of every n-gram of the request's
known tokens to the position after its latest occurrence, kept on the request (`Sequence.ngram_index`)
and extended by the tokens appended since the last draft, so a draft costs O(new tokens), not O(context).

Verification (`verify`): one forward over [last token + k draft tokens] gives the target distribution p_i
at each of the k + 1 positions (temperature, top-k and top-p applied as `sampler.sample` applies them).
Draft token x_i is accepted with probability p_i(x_i) (greedy: iff it is the argmax); at the first
rejection a token is drawn from p_i with x_i removed and renormalised (greedy: the argmax), and when all
k are accepted a bonus token is drawn from p_k. A draft is a point mass, so this is standard speculative
sampling: every emitted token has the target's distribution. Invariant: the logprob of every emitted
token is log p_i(token), the quantity `sampler.sample` reports for the same row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandemrl.engine.sampler import draw, target_probs
from tandemrl.engine.sequence import Sequence


@dataclass
class NgramIndex:
    """n-gram (a tuple of token ids) -> the position after its latest occurrence that has a successor."""

    positions: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_ends: int = 0  # n-grams ending before this position are indexed


class NgramDrafter:
    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int):
        assert 1 <= ngram_min <= ngram_max and num_draft_tokens >= 1
        self.num_draft_tokens = num_draft_tokens
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # largest first

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(max_tokens, num_draft_tokens) tokens that followed the latest earlier occurrence of
        `seq`'s longest matching suffix; empty when no suffix occurred before."""
        assert not seq.num_pending, "a draft extends known tokens"
        num = min(max_tokens, self.num_draft_tokens)
        if num <= 0:
            return []
        ids = seq.all_ids
        index = seq.ngram_index
        if index is None:
            index = seq.ngram_index = NgramIndex()
        self._extend(index, ids)
        length = len(ids)
        for n in self.sizes:
            if n > length:
                continue
            start = index.positions.get(tuple(ids[length - n :]))
            if start is not None:
                return ids[start : start + num]
        return []

    def _extend(self, index: NgramIndex, ids: list[int]) -> None:
        """Index the n-grams ending at positions num_ends .. len - 2 (the last token has no successor yet)."""
        positions = index.positions
        for end in range(index.num_ends, len(ids) - 1):
            for n in self.sizes:
                if n <= end + 1:
                    positions[tuple(ids[end + 1 - n : end + 1])] = end + 1
        index.num_ends = max(index.num_ends, len(ids) - 1)


def verify(
    logits_RV: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None
) -> tuple[list[list[int]], list[list[float]]]:
    """Accept or reject each sequence's draft (`Sequence.draft_ids`) against the target logits of its
    1 + len(draft) rows (in batch order); returns each sequence's emitted tokens and their logprobs."""
    device = logits_RV.device
    counts = [1 + len(s.draft_ids) for s in seqs]
    params = [s.params for s in seqs for _ in range(1 + len(s.draft_ids))]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    top_ks = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    probs_RV = target_probs(logits_RV, temps, top_ps, top_ks)
    greedy_R = temps == 0
    argmax_R = torch.log_softmax(logits_RV.float(), -1).argmax(-1)  # what `sample` picks for a greedy row
    # row r's draft token is the one that follows its input; a sequence's last row has none (-1)
    nexts = [t for s in seqs for t in [*s.draft_ids, -1]]
    next_R = torch.tensor(nexts, dtype=torch.long, device=device)
    has_next = next_R >= 0
    safe_next = torch.where(has_next, next_R, torch.zeros_like(next_R))
    p_next = probs_RV.gather(-1, safe_next[:, None]).squeeze(-1)
    uniform = torch.rand(len(params), generator=generator, device=device)
    accepted = has_next & torch.where(greedy_R, argmax_R == next_R, uniform < p_next)
    accepted_list = accepted.tolist()
    # per sequence: its first row that is not accepted (a rejection, or the last row: the bonus)
    final_rows, start = [], 0
    for count in counts:
        row = start
        while accepted_list[row]:
            row += 1
        final_rows.append(row)
        start += count
    final_R = torch.tensor(final_rows, dtype=torch.long, device=device)
    residual = probs_RV[final_R]
    rejected = has_next[final_R]  # a final row with a draft token rejected it: draw without it
    residual[rejected, safe_next[final_R][rejected]] = 0
    # a rejected token held all the mass but for rounding (p(x) just below 1, the rest underflowed to 0):
    # nothing is left to draw from, so the token stands
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs_RV[final_R])
    final_tokens = torch.where(greedy_R[final_R], argmax_R[final_R], draw(residual, generator))
    emitted, rows, start = [], [], 0
    for count, row, token in zip(counts, final_rows, final_tokens.tolist(), strict=True):
        emitted.append(nexts[start:row] + [token])  # the accepted draft tokens, then the final one
        rows += range(start, row + 1)
        start += count
    flat = [t for tokens in emitted for t in tokens]
    picked = probs_RV[torch.tensor(rows, device=device), torch.tensor(flat, device=device)].log().tolist()
    logprobs, start = [], 0
    for tokens in emitted:
        logprobs.append(picked[start : start + len(tokens)])
        start += len(tokens)
    return emitted, logprobs
