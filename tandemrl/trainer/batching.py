"""Training samples and their grouping into micro-batches by a token budget, in one of two layouts.

packed (for flash_attention_2 and torch's varlen kernel, trainer/varlen.py): samples are concatenated into
  one row whose `position_ids` restart at 0 for every sample, with the boundaries in `cu_seqlens_S`
  (handed to the attention layers); HF models also read the restarts as sequence boundaries (a
  block-diagonal mask for sdpa/eager), so a packed forward equals separate forwards. Zero padding. The
  forward must pass `use_cache=False` and no attention_mask: with either, HF skips that detection.
padded (for sdpa/eager): samples sorted by length are stacked as rows of similar length, right-padded,
  with an attention_mask. sdpa has no varlen kernel, so a packed row would cost (sum of lengths)^2 in
  attention; length-sorted rows cost sum of length^2 plus a little padding (counted in the budget).
Both layouts are checked in tests/unit/test_batching.py against per-sample forwards on CPU.

Layout invariant: tensors ending in `_N` are flat over the R x L grid (N = R * L, row-major); position n
holds the prediction of the *next* token of its sample: `labels_N[n] = input_ids[t + 1]`, `mask_N[n] =
loss_mask[t + 1]`, `old_logprobs_N[n] = old_logprobs[t + 1]`; the last token of a sample and padding
predict nothing (mask 0); `behav_logprobs_N` and `lags_N` likewise. Per-sample lists are aligned with `input_ids` (entry 0 is 0.0), like
`TrainSample.old_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TENSOR_FIELDS = (
    "input_ids_RL",
    "position_ids_RL",
    "labels_N",
    "mask_N",
    "old_logprobs_N",
    "advantages_N",
    "behav_logprobs_N",
    "lags_N",
    "select_K",
)


@dataclass
class TrainSample:
    """One trajectory ready to train on; all lists are aligned with `input_ids`.

    `loss_mask` is 1 on model-sampled tokens (0 on the prompt and tool output); `old_logprobs` holds the
    rollout logprob of each masked token (0.0 elsewhere); `advantage` applies to every masked token.
    `behav_logprobs` is set once the actor has recomputed `old_logprobs` for an off-policy correction: it
    keeps the rollout's (behaviour policy's) logprobs; None means they equal `old_logprobs`. `lags`: how
    many weight versions each sampled token is behind the actor's weights at the step's start (0 on the
    prompt and tool output; None: all 0), for `algorithm.proximal_logprobs=loglinear`.
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantage: float = 0.0
    behav_logprobs: list[float] | None = None
    lags: list[int] | None = None

    def __post_init__(self):
        behav = self.old_logprobs if self.behav_logprobs is None else self.behav_logprobs
        lags = self.input_ids if self.lags is None else self.lags
        if not (
            len(self.input_ids) == len(self.loss_mask) == len(self.old_logprobs) == len(behav) == len(lags)
        ):
            raise ValueError(
                f"TrainSample lists differ in length: input_ids {len(self.input_ids)}, loss_mask "
                f"{len(self.loss_mask)}, old_logprobs {len(self.old_logprobs)}, behav_logprobs {len(behav)}, "
                f"lags {len(lags)}; they must be aligned per token."
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask[1:])  # the first token is never predicted


@dataclass
class MicroBatch:
    """Several samples as an R x L grid; see the module docstring for the layouts."""

    input_ids_RL: torch.Tensor
    position_ids_RL: torch.Tensor
    attention_mask_RL: torch.Tensor | None  # None when packed
    labels_N: torch.Tensor
    mask_N: torch.Tensor  # float 0/1
    old_logprobs_N: torch.Tensor
    advantages_N: torch.Tensor
    behav_logprobs_N: torch.Tensor  # the rollout's logprobs (= old_logprobs_N unless recomputed)
    lags_N: torch.Tensor  # float: weight versions the token is behind the step's starting weights
    sample_indices: list[int] = field(default_factory=list)  # into the list given to `build_micro_batch`
    sample_lengths: list[int] = field(default_factory=list)
    sample_offsets: list[int] = field(default_factory=list)  # flat position of each sample's first token
    select_K: torch.Tensor | None = None  # flat positions with mask 1, computed on the host
    cu_seqlens_S: torch.Tensor | None = None  # packed: int32 sample boundaries in the row (0, ..., L)
    max_seqlen: int = 0  # packed: the longest sample

    def __post_init__(self):
        if self.select_K is None:
            # a micro-batch without loss tokens (rank padding) still runs one position, weighted 0,
            # so every rank runs the same forwards and FSDP's collectives stay in step
            self.select_K = (
                self.mask_N.nonzero()[:, 0] if self.mask_N.any() else torch.zeros(1, dtype=torch.long)
            )

    @property
    def num_tokens(self) -> int:
        """Tokens the forward processes (padding included)."""
        return self.input_ids_RL.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        """On the device; to CUDA from pinned memory, so the copy is queued on the stream and the host
        runs on to the next micro-batch (from pageable memory it would wait for the GPU to drain)."""
        device = torch.device(device)
        moved = {name: _to_device(getattr(self, name), device) for name in TENSOR_FIELDS}
        optional = {
            name: None if getattr(self, name) is None else _to_device(getattr(self, name), device)
            for name in ("attention_mask_RL", "cu_seqlens_S")
        }
        return MicroBatch(
            **moved,
            **optional,
            max_seqlen=self.max_seqlen,
            sample_indices=self.sample_indices,
            sample_lengths=self.sample_lengths,
            sample_offsets=self.sample_offsets,
        )

    def split_per_sample(self, values_N: torch.Tensor) -> list[list[float]]:
        """Per-position values (next-token layout) back to per-sample lists aligned with input_ids."""
        flat = values_N.detach().float().cpu().tolist()
        return [
            [0.0] + flat[start : start + length - 1]
            for start, length in zip(self.sample_offsets, self.sample_lengths, strict=True)
        ]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _next_token_fields(s: TrainSample) -> tuple[list[int], list[int], list[float], list[float]]:
    behav = s.old_logprobs if s.behav_logprobs is None else s.behav_logprobs
    return s.input_ids[1:] + [0], s.loss_mask[1:] + [0], s.old_logprobs[1:] + [0.0], behav[1:] + [0.0]


def build_micro_batch(samples: list[TrainSample], indices: list[int], padded: bool = False) -> MicroBatch:
    """`samples[i] for i in indices` as one packed row, or as right-padded rows when `padded`."""
    chosen = [samples[i] for i in indices]
    width = max(s.num_tokens for s in chosen) if padded else sum(s.num_tokens for s in chosen)
    num_rows = len(chosen) if padded else 1
    ids, pos, attn = (torch.zeros(num_rows, width, dtype=torch.long) for _ in range(3))
    labels = torch.zeros(num_rows * width, dtype=torch.long)
    mask, old, adv, behav, lags = (torch.zeros(num_rows * width) for _ in range(5))
    offsets, start = [], 0
    lengths = [s.num_tokens for s in chosen]
    cu_seqlens = (
        None if padded else torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    )
    for row, s in enumerate(chosen):
        n = s.num_tokens
        r, c = (row, 0) if padded else (0, start)
        flat = r * width + c
        ids[r, c : c + n] = torch.tensor(s.input_ids)
        pos[r, c : c + n] = torch.arange(n)
        attn[r, c : c + n] = 1
        next_labels, next_mask, next_old, next_behav = _next_token_fields(s)
        labels[flat : flat + n] = torch.tensor(next_labels)
        mask[flat : flat + n] = torch.tensor(next_mask, dtype=torch.float32)
        old[flat : flat + n] = torch.tensor(next_old, dtype=torch.float32)
        behav[flat : flat + n] = torch.tensor(next_behav, dtype=torch.float32)
        if s.lags is not None:  # None: all 0, as the tensor already is (every proximal policy but loglinear)
            lags[flat : flat + n] = torch.tensor(s.lags[1:] + [0], dtype=torch.float32)
        adv[flat : flat + n] = s.advantage
        offsets.append(flat)
        start += n
    return MicroBatch(
        ids,
        pos,
        attn if padded else None,
        labels,
        mask,
        old,
        adv,
        behav,
        lags,
        sample_indices=list(indices),
        sample_lengths=lengths,
        sample_offsets=offsets,
        cu_seqlens_S=cu_seqlens,
        max_seqlen=max(lengths),
    )


def pack_indices(lengths: list[int], max_tokens: int, padded: bool = False) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `max_tokens` processed tokens.

    packed: first-fit decreasing on lengths (no padding). padded: longest first, a group grows while
    rows x its longest length fits and the next sample is at least 3/4 of that longest, so each row
    wastes under a quarter of its width on padding. A sample longer than `max_tokens` gets a group of its own (it cannot be split without
    changing its attention). Deterministic; each group lists its indices in increasing order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    if padded:
        for i in order:
            longest = lengths[bins[-1][0]] if bins else 0
            if bins and (len(bins[-1]) + 1) * longest <= max_tokens and 4 * lengths[i] >= 3 * longest:
                bins[-1].append(i)
            else:
                bins.append([i])
        return [sorted(b) for b in bins]
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
    return [samples[bounds[k] : bounds[k + 1]] for k in range(num)]


def partition_for_ranks(samples: list[TrainSample], num_ranks: int) -> list[list[int]]:
    """Balance samples across ranks by token count (greedy, longest first); indices per rank, sorted."""
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += samples[i].num_tokens
    return [sorted(p) for p in parts]


def plan_rank_micro_batches(
    samples: list[TrainSample], rank: int, num_ranks: int, max_tokens: int, padded: bool = False
) -> list[MicroBatch]:
    """This rank's micro-batches of one minibatch, padded with empty ones to the max count over ranks.

    Every rank holds the whole minibatch, so every rank computes the same plan without communicating;
    equal micro-batch counts keep FSDP's per-forward collectives in lockstep. A padding micro-batch
    has mask 0 everywhere, so it contributes zero loss and zero gradient.
    """
    parts = partition_for_ranks(samples, num_ranks)
    plans = []
    for part in parts:
        groups = pack_indices([samples[i].num_tokens for i in part], max_tokens, padded)
        plans.append([[part[j] for j in group] for group in groups])
    micro = [build_micro_batch(samples, group, padded) for group in plans[rank]]
    while len(micro) < max(len(p) for p in plans):
        micro.append(_empty_micro_batch(samples, padded))
    return micro


def _empty_micro_batch(samples: list[TrainSample], padded: bool) -> MicroBatch:
    shortest = min(samples, key=lambda s: s.num_tokens)
    n = min(2, shortest.num_tokens)
    micro = build_micro_batch([TrainSample(shortest.input_ids[:n], [0] * n, [0.0] * n)], [0], padded)
    micro.sample_indices, micro.sample_lengths, micro.sample_offsets = [], [], []
    return micro
