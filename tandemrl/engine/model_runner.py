"""Runs one scheduled step on the model: builds the flat inputs and attention metadata, forwards, samples.

Owns the model, the KV cache tensors and the sampling generator. Invariant: after `launch`, every
sequence in the batch has its tokens up to the step's end in the cache (`num_cached_tokens` =
`Sequence.step_end`: a prefill chunk's end, else all its tokens but the newly sampled one); the caller
appends the sampled token once the step's `StepResult` is read, and ignores a chunk's row. This
reference runner computes the step inside `launch`; the CUDA runner (`fast_model_runner.FastModelRunner`,
`overlaps`) returns while the GPU works, so the engine can schedule the next step meanwhile.
"""

from __future__ import annotations

import torch

from tandemrl.engine.attention import build_metadata
from tandemrl.engine.kv_cache import allocate_kv_caches
from tandemrl.engine.model import CausalLM
from tandemrl.engine.sampler import sample
from tandemrl.engine.sequence import Sequence
from tandemrl.engine.speculative import verify
from tandemrl.host.startup import mark


class StepResult:
    """The sampled token and logprob of each sequence of a launched step (of a verify step: the list of
    tokens each emits, `launch_verify`); `get()` waits for them."""

    def __init__(self, token_ids: list, logprobs: list):
        self._token_ids, self._logprobs = token_ids, logprobs

    def get(self) -> tuple[list, list]:
        return self._token_ids, self._logprobs


def flatten_uncached(
    seqs: list[Sequence], pending_ids: dict[str, int] | None = None
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The step's flat inputs: each sequence's uncached token ids and positions up to its step end (a
    prefill chunk's end, else all its tokens), with the per-sequence query lengths (new tokens) and
    context lengths (cached + new). A pending token (sampled by the last launch, not yet postprocessed)
    is its sequence's last input: its id comes from `pending_ids` (by request id), or is 0 for the CUDA
    runner to fill in on the device. A speculative draft (`Sequence.draft_ids`) follows the last token."""
    input_ids, positions, query_lens, context_lens = [], [], [], []
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.step_end
        assert end > start, "a scheduled sequence must have an uncached token"
        assert seq.num_pending <= 1, "only the last launch's token can be pending at a launch"
        assert seq.chunk_end is None or not seq.num_pending, "a prefill chunk's tokens are all known"
        input_ids.extend(seq.all_ids[start:end])
        if seq.num_pending:
            input_ids.append(pending_ids[seq.rid] if pending_ids is not None else 0)
        num_draft = len(seq.draft_ids)
        input_ids.extend(seq.draft_ids)
        positions.extend(range(start, end + num_draft))
        query_lens.append(end + num_draft - start)
        context_lens.append(end + num_draft)
    return input_ids, positions, query_lens, context_lens


class ModelRunner:
    overlaps = False  # whether the engine overlaps steps by default (this runner computes inside launch)

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
    ):
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_caches = allocate_kv_caches(model.cfg, num_blocks, block_size, dtype, device)
        mark("engine: KV cache allocated")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.last_sampled: dict[str, int] = {}  # the last launch's tokens: the pending ids of the next one

    @torch.inference_mode()
    def forward_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Forward each sequence's uncached tokens up to its step end; returns last-token logits `[B, V]`,
        and with speculative drafts the logits of the last token and of every draft token `[R, V]` (the
        drafts' K/V is written, but `num_cached_tokens` counts it only once the engine accepts it)."""
        input_ids, positions, query_lens, context_lens = flatten_uncached(seqs, self.last_sampled)
        meta = build_metadata(
            query_lens, context_lens, [s.block_table for s in seqs], self.block_size, self.device
        )
        if any(s.draft_ids for s in seqs):
            ends = torch.cumsum(torch.tensor(query_lens), 0).tolist()
            rows = [i for s, e in zip(seqs, ends, strict=True) for i in range(e - 1 - len(s.draft_ids), e)]
            meta.last_token_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        logits = self.model(ids, pos, self.kv_caches, meta)
        for seq in seqs:
            seq.num_cached_tokens = seq.step_end
        return logits

    def launch(self, seqs: list[Sequence]) -> StepResult:
        token_ids, logprobs = self.run(seqs)
        self.last_sampled = {s.rid: t for s, t in zip(seqs, token_ids, strict=True)}
        return StepResult(token_ids, logprobs)

    @torch.inference_mode()
    def launch_verify(self, seqs: list[Sequence]) -> StepResult:
        """A decode step that verifies the sequences' drafts: per sequence a list of emitted tokens and
        their logprobs (engine/speculative.py)."""
        token_ids, logprobs = verify(self.forward_logits(seqs), seqs, self.generator)
        self.last_sampled = {s.rid: t[-1] for s, t in zip(seqs, token_ids, strict=True)}
        return StepResult(token_ids, logprobs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        logits = self.forward_logits(seqs)
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        top_ks = torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device)
        token_ids, logprobs = sample(logits, temps, top_ps, top_ks, self.generator)
        return token_ids.tolist(), logprobs.tolist()
