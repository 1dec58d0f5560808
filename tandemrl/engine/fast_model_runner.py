"""The CUDA fast path of the model runner: Triton attention, CUDA-graph decode and prefill, sampling on the
GPU, and steps that overlap the host.

`FastModelRunner` keeps `ModelRunner`'s contract and changes how a step executes: decode steps replay a
CUDA graph captured for the smallest captured batch size >= the batch (padding rows write no KV and attend
to nothing) that runs the forward *and* the sampler; prefill steps replay one captured per token bucket
(engine/prefill_graphs.py) or, past the buckets, run eagerly with the same Triton kernels. All of a step's
host inputs go to the GPU in one copy from a pinned buffer, and the sampled tokens and logprobs come back
by an asynchronous copy: `launch` returns before the GPU is done, so the engine schedules step n+1 while
step n runs. Step n+1 therefore starts before the host has seen step n's tokens: a sequence's pending
input token is read on the device, from the rows step n sampled into (`tokens_B`). Weight updates copy into the parameters in place, so captured graphs stay valid across them.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch

from tandemrl.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_size
from tandemrl.engine.model import CausalLM
from tandemrl.engine.model_runner import ModelRunner, StepResult, flatten_uncached
from tandemrl.engine.pinned_staging import PinnedStaging
from tandemrl.engine.sampler import sample
from tandemrl.engine.sequence import Sequence
from tandemrl.engine.speculative import verify
from tandemrl.host.startup import mark

# Triton is imported only on the CUDA path (`triton_attention`, `fast_layers`): CPU installs need not have it.

logger = logging.getLogger(__name__)

_TUNE_CONTEXT = 512  # attention kernels are timed at this context length (or the max, if smaller)
_TUNE_PREFILL_TOKENS = 16384  # prefill tiles are timed on a step of this many tokens (or the budget)


def fast_path_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Triton kernels run on CUDA in half precision with power-of-two head sizes; else the reference path."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


class _PendingResult(StepResult):
    """A launched step's tokens and logprobs, on their way to pinned host memory."""

    def __init__(self, event: torch.cuda.Event, ids: torch.Tensor, logprobs: torch.Tensor):
        self.event, self.ids, self.logprobs = event, ids, logprobs

    def get(self) -> tuple[list[int], list[float]]:
        self.event.synchronize()
        return self.ids.tolist(), self.logprobs.tolist()


class FastModelRunner(ModelRunner):
    overlaps = True

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        max_batch: int,
        max_context_len: int,
        use_cuda_graphs: bool = True,
        max_prefill_tokens: int = 8192,
        prefill_cuda_graphs: bool = True,
    ):
        super().__init__(model, num_blocks, block_size, device, dtype, seed)
        from tandemrl.engine.fast_layers import fast_forward, fuse_projections

        fused = fuse_projections(model)
        self.forward = lambda ids, pos, kv_caches, meta, down_split=1, embeds=None: fast_forward(
            model, fused, ids, pos, kv_caches, meta, down_split, embeds
        )
        model.rope.keep_table(max_context_len, dtype)  # a step gathers its positions' cos/sin rows
        from tandemrl.engine.tuning_cache import choose_kernels

        self.batch_sizes = graph_batch_sizes(max_batch)
        choices = choose_kernels(
            model,
            self.kv_caches,
            max_batch,
            min(max_context_len, _TUNE_CONTEXT),
            min(max_prefill_tokens, _TUNE_PREFILL_TOKENS),
            block_size,
            self.batch_sizes,
            split_k=os.environ.get("TANDEM_ENGINE_SPLIT_K", "1") != "0",  # "0": cuBLAS alone (A/B timing)
        )
        self.decode_config, self.decode_timings = choices.decode_config, choices.decode_timings
        self.prefill_config, self.prefill_timings = choices.prefill_config, choices.prefill_timings
        self.down_splits, self.down_split_timings = choices.down_splits, choices.down_split_timings
        cached = f" (from the tuning cache: {', '.join(choices.from_cache)})" if choices.from_cache else ""
        logger.info("decode attention: %s (timings ms %s)", self.decode_config, self.decode_timings)
        logger.info("prefill attention: %s (timings ms %s)", self.prefill_config, self.prefill_timings)
        logger.info("down projection split-K parts per decode batch size: %s%s", self.down_splits, cached)
        self.seeds = np.random.default_rng(seed)
        # The last launched step's samples, row by row: the next step reads its pending ids from here.
        self.tokens_B = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.logprobs_B = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.prev_rows: dict[str, int] = {}
        # Two read-back buffers: step n+1 is launched before step n is read.
        self.readback = [
            (torch.zeros(max_batch, dtype=torch.long).pin_memory(), torch.zeros(max_batch).pin_memory())
            for _ in range(2)
        ]
        self.num_launches = 0
        self.staging = PinnedStaging(device)
        max_blocks_per_seq = -(-max_context_len // block_size)
        self.graphs = (
            DecodeGraphs(
                self.forward,
                self.kv_caches,
                self.tokens_B,
                self.logprobs_B,
                max_blocks_per_seq,
                block_size,
                self.decode_config,
                model.model.embed_tokens.weight,
                self.down_splits,
            )
            if use_cuda_graphs
            else None
        )
        self.prefill_graphs = None
        if use_cuda_graphs and prefill_cuda_graphs:
            from tandemrl.engine.prefill_graphs import PrefillGraphs
            from tandemrl.engine.triton_attention import prefill_block_m

            attn = model.model.layers[0].self_attn
            block_m = prefill_block_m(attn.num_heads, attn.num_kv_heads, self.prefill_config)
            self.prefill_graphs = PrefillGraphs(
                self.forward,
                self.kv_caches,
                self.tokens_B,
                self.logprobs_B,
                max_blocks_per_seq,
                block_size,
                max_prefill_tokens,
                block_m // (attn.num_heads // attn.num_kv_heads),
                self.decode_config,
                self.prefill_config,
                model.model.embed_tokens.weight,
            )
        mark("engine: CUDA graphs captured" if use_cuda_graphs else "engine: CUDA graphs off")

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence]) -> StepResult:
        num_seqs = len(seqs)
        prev_rows = self.prev_rows
        src_rows = [prev_rows[s.rid] if s.num_pending else -1 for s in seqs]
        params = [s.params for s in seqs]
        temps = [p.temperature for p in params]
        seed = int(self.seeds.integers(2**31 - 1))
        truncated = any(t > 0 and (p.top_p < 1 or p.top_k > 0) for t, p in zip(temps, params, strict=True))
        # A prefill chunk stops short of its request's last token (>= 2 uncached): it never replays a decode graph.
        if self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs, src_rows, temps, seed)  # samples too
        elif self.prefill_graphs is not None and (bucket := self.prefill_graphs.bucket_for(seqs)) is not None:
            logits = self.prefill_graphs.run(bucket, seqs, src_rows, temps, seed)  # samples too
        else:
            logits = self._forward_eager(seqs, src_rows, temps, seed)
        if truncated:  # the reference sampler (a few host syncs) overwrites the fused one's draw
            ids, logprobs = sample(
                logits,
                torch.tensor(temps, dtype=torch.float32, device=self.device),
                torch.tensor([p.top_p for p in params], device=self.device),
                torch.tensor([p.top_k for p in params], device=self.device),
                self.generator,
            )
            self.tokens_B[:num_seqs], self.logprobs_B[:num_seqs] = ids, logprobs
        for seq in seqs:
            seq.num_cached_tokens = seq.step_end
        self.prev_rows = {s.rid: i for i, s in enumerate(seqs)}
        ids_host, logprobs_host = self.readback[self.num_launches % 2]
        self.num_launches += 1
        ids_host[:num_seqs].copy_(self.tokens_B[:num_seqs], non_blocking=True)
        logprobs_host[:num_seqs].copy_(self.logprobs_B[:num_seqs], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _PendingResult(event, ids_host[:num_seqs], logprobs_host[:num_seqs])

    @torch.inference_mode()
    def launch_verify(self, seqs: list[Sequence]) -> StepResult:
        """A speculative decode step (engine/speculative.py). A batch without drafts is a plain decode step
        (its captured graph); with drafts, one eager Triton forward over each request's last token and
        draft gives the logits of every one of those positions, which `verify` accepts or rejects. The
        engine does not overlap steps while it speculates, so no input token is pending here."""
        assert not any(s.num_pending for s in seqs), "a verify step's inputs are all known"
        if not any(s.draft_ids for s in seqs):
            ids, logprobs = self.launch(seqs).get()
            return StepResult([[t] for t in ids], [[lp] for lp in logprobs])
        token_ids, logprobs = verify(self._verify_logits(seqs), seqs, self.generator)
        self.prev_rows = {}  # nothing of this step is read on the device by the next
        return StepResult(token_ids, logprobs)

    def _verify_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits `[R, V]` at each sequence's last token and every draft token, in batch order: its uncached
        tokens forwarded as a prefill chunk over its cached context (the ragged Triton attention), every
        row kept (`fast_forward` prunes its last layer only when `last_token_index` has fewer rows than the
        step has tokens). The drafts' K/V is written; `num_cached_tokens` counts it once accepted."""
        from tandemrl.engine.triton_attention import host_metadata

        input_ids, positions, query_lens, context_lens = flatten_uncached(seqs)
        meta = host_metadata(query_lens, context_lens, [s.block_table for s in seqs], self.block_size)
        ends = np.cumsum(query_lens)
        rows = np.concatenate(
            [np.arange(end - 1 - len(s.draft_ids), end) for s, end in zip(seqs, ends, strict=True)]
        )
        num_tokens, num_meta = len(input_ids), len(meta.ints)
        # metadata | ids | positions | the rows verify reads
        ints = np.concatenate(
            [
                meta.ints,
                np.asarray(input_ids, dtype=np.int64),
                np.asarray(positions, dtype=np.int64),
                rows.astype(np.int64),
            ]
        )
        dev, _ = self.staging.copy(ints, np.zeros(0, dtype=np.float32))
        fast_meta = meta.on_device(dev[:num_meta], self.block_size, self.decode_config, self.prefill_config)
        every_row = torch.arange(num_tokens, device=self.device)
        fast_meta = dataclasses.replace(fast_meta, last_token_index=every_row)
        step = dev[num_meta:]
        logits = self.forward(step[:num_tokens], step[num_tokens : 2 * num_tokens], self.kv_caches, fast_meta)
        for seq in seqs:
            seq.num_cached_tokens = seq.step_end
        if (
            len(rows) < num_tokens
        ):  # a request with more than its last token uncached (none in a decode batch)
            logits = logits[step[2 * num_tokens :]]
        return logits

    def _forward_eager(
        self, seqs: list[Sequence], src_rows: list[int], temps: list[float], seed: int
    ) -> torch.Tensor:
        """Prefill, chunks included (or a decode batch no graph fits): forward and fused sampling, eagerly.
        A row's pending token is its last input (a chunk has none), so it sits at the row's query end."""
        from tandemrl.engine.gpu_sampler import fused_sample
        from tandemrl.engine.triton_attention import host_metadata

        num_seqs = len(seqs)
        input_ids, positions, query_lens, context_lens = flatten_uncached(seqs)
        meta = host_metadata(query_lens, context_lens, [s.block_table for s in seqs], self.block_size)
        ends = np.cumsum(query_lens) - 1
        pending = np.array([(ends[i], row) for i, row in enumerate(src_rows) if row >= 0], dtype=np.int64)
        num_tokens, num_meta = len(input_ids), len(meta.ints)
        # metadata | ids | positions | seed | pending token indices | their rows in tokens_B
        ints = np.concatenate(
            [
                meta.ints,
                np.asarray(input_ids, dtype=np.int64),
                np.asarray(positions, dtype=np.int64),
                np.array([seed], dtype=np.int64),
                pending.T.ravel(),
            ]
        )
        dev, temps_B = self.staging.copy(ints, np.asarray(temps, dtype=np.float32))
        fast_meta = meta.on_device(dev[:num_meta], self.block_size, self.decode_config, self.prefill_config)
        step = dev[num_meta:]
        ids, pos = step[:num_tokens], step[num_tokens : 2 * num_tokens]
        seed_dev = step[2 * num_tokens : 2 * num_tokens + 1]
        if len(pending):
            index, rows = step[2 * num_tokens + 1 :].view(2, len(pending))
            ids[index] = self.tokens_B[rows]
        # An eager decode batch (one token per sequence) splits its down projections as the decode graph
        # of its size would, so greedy outputs do not depend on whether graphs are enabled.
        down_split = 1
        if num_tokens == num_seqs:
            down_split = self.down_splits.get(graph_size(self.batch_sizes, num_tokens), 1)
        logits = self.forward(ids, pos, self.kv_caches, fast_meta, down_split)
        fused_sample(logits, temps_B, seed_dev, self.tokens_B[:num_seqs], self.logprobs_B[:num_seqs])
        return logits


def build_runner(
    model: CausalLM, num_blocks: int, config, device: torch.device, dtype: torch.dtype
) -> ModelRunner:
    """The reference runner on CPU (and fp32 CUDA), the fast one on CUDA in bf16/fp16."""
    if not fast_path_supported(device, dtype, model.cfg["head_dim"]):
        return ModelRunner(model, num_blocks, config.block_size, device, dtype, config.seed)
    return FastModelRunner(
        model,
        num_blocks,
        config.block_size,
        device,
        dtype,
        config.seed,
        max_batch=config.max_running_requests,
        max_context_len=config.max_context_len,
        use_cuda_graphs=config.enable_cuda_graphs,
        max_prefill_tokens=config.max_prefill_tokens,
        prefill_cuda_graphs=config.prefill_cuda_graphs,
    )
