"""Training samples and their packing into micro-batches by a token budget, without padding.

Samples are concatenated into one row (`input_ids_1T`) whose `position_ids` restart at 0 for every
sample; Hugging Face models (transformers >= 4.56, sdpa/eager/flash) read the restarts as sequence
boundaries and build a block-diagonal causal mask, so a packed forward equals separate forwards (checked
in tests/unit/test_batching.py against per-sample forwards on CPU). The forward must pass
`use_cache=False` and no attention_mask: with a KV cache HF skips the packed-sequence detection.

Layout invariant: position t of a micro-batch holds the prediction of the *next* token of the same
sample: `labels_T[t] = input_ids[t + 1]`, `mask_T[t] = loss_mask[t + 1]`, `old_logprobs_T[t] =
old_logprobs[t + 1]`; the last position of each sample predicts nothing (mask 0). Per-sample logprob
lists are aligned with `input_ids` (entry 0 is 0.0), like `TrainSample.old_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainSample:
    """One trajectory ready to train on; all lists are aligned with `input_ids`.

    `loss_mask` is 1 on model-sampled tokens (0 on the prompt and tool output); `old_logprobs` holds the
    rollout logprob of each masked token (0.0 elsewhere); `advantage` applies to every masked token.
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantage: float = 0.0

    def __post_init__(self):
        if not (len(self.input_ids) == len(self.loss_mask) == len(self.old_logprobs)):
            raise ValueError(
                f"TrainSample lists differ in length: input_ids {len(self.input_ids)}, loss_mask "
                f"{len(self.loss_mask)}, old_logprobs {len(self.old_logprobs)}; they must be aligned per token.")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask[1:])  # the first token is never predicted


@dataclass
class MicroBatch:
    """Packed tensors of several samples; see the module docstring for the layout."""

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    labels_T: torch.Tensor
    mask_T: torch.Tensor  # float 0/1
    old_logprobs_T: torch.Tensor
    advantages_T: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)  # into the list given to `pack`
    sample_lengths: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1T.shape[1])

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {name: getattr(self, name).to(device) for name in
                 ("input_ids_1T", "position_ids_1T", "labels_T", "mask_T", "old_logprobs_T", "advantages_T")}
        return MicroBatch(**moved, sample_indices=self.sample_indices, sample_lengths=self.sample_lengths)

    def split_per_sample(self, values_T: torch.Tensor) -> list[list[float]]:
        """Per-position values (next-token layout) back to per-sample lists aligned with input_ids."""
        out, start = [], 0
        flat = values_T.detach().float().cpu().tolist()
        for length in self.sample_lengths:
            out.append([0.0] + flat[start:start + length - 1])
            start += length
        return out


def build_micro_batch(samples: list[TrainSample], indices: list[int]) -> MicroBatch:
    """Concatenate `samples[i] for i in indices` into one packed row."""
    ids, pos, labels, mask, old, adv, lengths = [], [], [], [], [], [], []
    for i in indices:
        s = samples[i]
        n = s.num_tokens
        ids += s.input_ids
        pos += range(n)
        labels += s.input_ids[1:] + [0]
        mask += s.loss_mask[1:] + [0]
        old += s.old_logprobs[1:] + [0.0]
        adv += [s.advantage] * n
        lengths.append(n)
    return MicroBatch(
        input_ids_1T=torch.tensor([ids], dtype=torch.long),
        position_ids_1T=torch.tensor([pos], dtype=torch.long),
        labels_T=torch.tensor(labels, dtype=torch.long),
        mask_T=torch.tensor(mask, dtype=torch.float32),
        old_logprobs_T=torch.tensor(old, dtype=torch.float32),
        advantages_T=torch.tensor(adv, dtype=torch.float32),
        sample_indices=list(indices), sample_lengths=lengths)


def pack_indices(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sample lengths into bins of at most `max_tokens`.

    A sample longer than `max_tokens` gets a bin of its own (it cannot be split without changing its
    attention). Deterministic: ties are broken by index, bins keep their samples in index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def split_minibatches(samples: list[TrainSample], num_minibatches: int) -> list[list[TrainSample]]:
    """Contiguous, near-equal slices (in sample order, so GRPO groups stay together when they divide)."""
    num = min(num_minibatches, len(samples))
    bounds = [round(k * len(samples) / num) for k in range(num + 1)]
    return [samples[bounds[k]:bounds[k + 1]] for k in range(num)]


def partition_for_ranks(samples: list[TrainSample], num_ranks: int) -> list[list[int]]:
    """Balance samples across ranks by token count (greedy, longest first); indices per rank, sorted."""
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += samples[i].num_tokens
    return [sorted(p) for p in parts]


def plan_rank_micro_batches(samples: list[TrainSample], rank: int, num_ranks: int,
                            max_tokens: int) -> list[MicroBatch]:
    """This rank's micro-batches of one minibatch, padded with empty ones to the max count over ranks.

    Every rank holds the whole minibatch, so every rank computes the same plan without communicating;
    equal micro-batch counts keep FSDP's per-forward collectives in lockstep. A padding micro-batch
    has mask 0 everywhere, so it contributes zero loss and zero gradient.
    """
    parts = partition_for_ranks(samples, num_ranks)
    plans = [[[parts[r][j] for j in b] for b in pack_indices([samples[i].num_tokens for i in parts[r]],
                                                             max_tokens)] for r in range(num_ranks)]
    num_micro = max(len(p) for p in plans)
    micro = [build_micro_batch(samples, b) for b in plans[rank]]
    while len(micro) < num_micro:
        micro.append(_empty_micro_batch(samples))
    return micro


def _empty_micro_batch(samples: list[TrainSample]) -> MicroBatch:
    shortest = min(samples, key=lambda s: s.num_tokens)
    padding = TrainSample(shortest.input_ids[:2], [0] * min(2, shortest.num_tokens),
                          [0.0] * min(2, shortest.num_tokens), 0.0)
    micro = build_micro_batch([padding], [0])
    micro.sample_indices, micro.sample_lengths = [], []
    return micro
