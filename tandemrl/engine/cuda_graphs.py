"""The CUDA fast path of the model runner: Triton attention, CUDA-graph decode, sampling on the GPU, and
steps that overlap the host.

`FastModelRunner` keeps `ModelRunner`'s contract and changes how a step executes: decode steps replay a
CUDA graph captured for the smallest captured batch size >= the batch (padding rows write no KV and attend
to nothing) that runs the forward *and* the sampler; prefill steps run eagerly with the same Triton
kernels. All of a step's host inputs go to the GPU in one copy from a pinned buffer, and the sampled
tokens and logprobs come back by an asynchronous copy: `launch` returns before the GPU is done, so the
engine schedules step n+1 while step n runs. Step n+1 therefore starts before the host has seen step n's
tokens: a sequence's pending input token is read on the device, from the rows step n sampled into
(`tokens_B`). Weight updates copy into the parameters in place, so captured graphs stay valid across them.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from tandemrl.engine.model import CausalLM
from tandemrl.engine.model_runner import ModelRunner, StepResult, flatten_uncached
from tandemrl.engine.sampler import sample
from tandemrl.engine.sequence import Sequence
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


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, 2, 4, 8, max_batch} | set(range(16, max_batch + 1, 16))
    return sorted(s for s in sizes if s <= max_batch)


def graph_size(sizes: list[int], num_seqs: int) -> int | None:
    """The captured batch size a decode batch of `num_seqs` rows runs at (padded up), None past the largest."""
    return next((s for s in sizes if s >= num_seqs), None)


class _HostInputs:
    """A decode step's host inputs in one pinned buffer (int64 part, then float32 temperatures), copied to
    the device buffer in one go. Two host buffers take turns: the host fills step n+1's while the copy
    of step n's may still be queued (step n-1's read-back, which the host has waited for, precedes it)."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        m = max_batch
        self.num_ints = 5 * m + 1 + m * width
        num_bytes = self.num_ints * 8 + m * 4
        self.hosts = [torch.zeros(num_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.dev = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.turn = 0
        # whose block table each row of each host buffer holds: rows are rewritten only when it changed
        self.row_keys: list[list[tuple | None]] = [[None] * m for _ in range(2)]
        dev_ints = self.dev[: self.num_ints * 8].view(torch.long)
        self.temps_B = self.dev[self.num_ints * 8 :].view(torch.float32)
        # ids known on the host | row of a pending id in tokens_B (-1: none) | positions | slots | context
        # lengths | sampling seed | block tables
        self.ids, self.src = dev_ints[:m], dev_ints[m : 2 * m]
        self.positions, self.slots = dev_ints[2 * m : 3 * m], dev_ints[3 * m : 4 * m]
        self.context_lens, self.seed = dev_ints[4 * m : 5 * m], dev_ints[5 * m : 5 * m + 1]
        self.tables = dev_ints[5 * m + 1 :].view(m, width)

    def next_host(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, list[tuple | None]]:
        """The host buffer to fill for the next step: (tensor, int64 view, float32 view, its row keys)."""
        self.turn ^= 1
        host = self.hosts[self.turn]
        ints = host[: self.num_ints * 8].view(torch.long).numpy()
        return host, ints, host[self.num_ints * 8 :].view(torch.float32).numpy(), self.row_keys[self.turn]


class DecodeGraphs:
    """One captured decode step (forward + sampling) per batch size, sharing static inputs and one pool."""

    def __init__(
        self,
        forward,
        kv_caches: list[torch.Tensor],
        tokens_B: torch.Tensor,
        logprobs_B: torch.Tensor,
        max_blocks_per_seq: int,
        block_size: int,
        decode_config,
        embed_weight: torch.Tensor,
        down_splits: dict[int, int] | None = None,
    ):
        self.forward, self.kv_caches, self.block_size = forward, kv_caches, block_size
        self.embed_weight = embed_weight
        self.down_splits = down_splits or {}  # batch size -> split-K parts of the down projection
        self.tokens_B, self.logprobs_B = tokens_B, logprobs_B
        self.decode_config = decode_config
        self.max_batch, self.width = tokens_B.shape[0], max_blocks_per_seq
        self.sizes = graph_batch_sizes(self.max_batch)
        device = tokens_B.device
        self.inputs = _HostInputs(self.max_batch, max_blocks_per_seq, device)
        self.rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        self.ones = torch.ones(self.max_batch, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._capture()

    def _meta(self, size: int):
        from tandemrl.engine.triton_attention import FastMetadata

        inputs = self.inputs
        return FastMetadata(
            slot_mapping_T=inputs.slots[:size],
            query_start_B=self.rows[:size],
            query_lens_B=self.ones[:size],
            context_lens_B=inputs.context_lens[:size],
            block_tables_BW=inputs.tables[:size],
            last_token_index=self.rows[:size],
            max_query_len=1,
            block_size=self.block_size,
            max_context_len=self.width * self.block_size,
            decode=self.decode_config,
        )

    def _step(self, size: int) -> torch.Tensor:
        """The captured work: gather pending ids, forward, sample into tokens_B / logprobs_B."""
        from tandemrl.engine.fast_layers import embed_pending
        from tandemrl.engine.gpu_sampler import fused_sample

        inputs = self.inputs
        embeds = embed_pending(inputs.src[:size], self.tokens_B, inputs.ids[:size], self.embed_weight)
        logits = self.forward(
            None,
            inputs.positions[:size],
            self.kv_caches,
            self._meta(size),
            self.down_splits.get(size, 1),
            embeds,
        )
        fused_sample(logits, inputs.temps_B[:size], inputs.seed, self.tokens_B[:size], self.logprobs_B[:size])
        return logits

    @torch.inference_mode()
    def _capture(self) -> None:
        self.inputs.slots.fill_(-1)  # warm-up and capture write no KV
        self.inputs.src.fill_(-1)
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._step(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, seqs: list[Sequence]) -> bool:
        return len(seqs) <= self.max_batch and all(
            s.num_tokens - s.num_cached_tokens == 1 and len(s.block_table) <= self.width for s in seqs
        )

    def run(self, seqs: list[Sequence], src_rows: list[int], temps: list[float], seed: int) -> torch.Tensor:
        """Replay the step for this decode batch; returns its logits `[B, V]` (a view of a static buffer)."""
        num_seqs = len(seqs)
        size = graph_size(self.sizes, num_seqs)
        m, bs = self.max_batch, self.block_size
        host, h, host_temps, row_keys = self.inputs.next_host()
        ids, context_lens, slots = [], [], []
        for seq in seqs:  # one pass: this runs for every row of every decode step
            num_tokens = seq.num_tokens
            pos = num_tokens - 1
            ids.append(seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1])
            context_lens.append(num_tokens)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        h[:num_seqs] = ids
        h[m : m + num_seqs] = src_rows
        h[2 * m : 2 * m + num_seqs] = context_lens
        h[2 * m : 2 * m + num_seqs] -= 1  # positions
        h[3 * m : 3 * m + num_seqs] = slots
        h[4 * m : 4 * m + num_seqs] = context_lens
        h[m + num_seqs : m + size] = -1  # padding rows: no pending id,
        h[3 * m + num_seqs : 3 * m + size] = -1  # no KV write
        h[4 * m + num_seqs : 4 * m + size] = 0  # and no keys
        h[5 * m] = seed
        host_temps[:num_seqs] = temps
        host_temps[num_seqs:size] = 1.0
        tables = h[5 * m + 1 :].reshape(m, self.width)
        for i, seq in enumerate(seqs):  # tables only grow: a row changes when its owner or length does
            key = row_keys[i]  # (owner, table length, retractions); holding the owner keeps `is` sound
            table, retractions = seq.block_table, seq.num_retractions
            if key is not None and key[0] is seq and key[2] == retractions:
                if key[1] == len(table):
                    continue
                tables[i, key[1] : len(table)] = table[key[1] :]  # the same table, grown: new blocks only
            else:
                tables[i, : len(table)] = table
            row_keys[i] = (seq, len(table), retractions)
        self.inputs.dev.copy_(host, non_blocking=True)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:num_seqs]


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
        self.staging = _PinnedStaging(device)
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
        # A prefill chunk stops short of its request's last token (>= 2 uncached): it never replays a graph.
        if self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs, src_rows, temps, seed)  # samples too
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


class _PinnedStaging:
    """An eager step's host inputs (int64 values, then float32 values) in one pinned buffer, copied to a
    device buffer in one go. Fresh pinned tensors per step cost about a millisecond each to allocate; these
    buffers grow to the largest step seen and are kept. Two host buffers take turns, and a buffer is
    refilled only once its last copy has run (its event; two steps back, so it has). The device buffer
    is rewritten by the next step's copy, which the stream orders after this step's kernels."""

    def __init__(self, device: torch.device):
        self.device = device
        self.hosts: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.dev = torch.empty(0, dtype=torch.uint8, device=device)
        self.turn = 0

    def copy(self, ints: np.ndarray, floats: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of `ints` (int64) and `floats` (float32), in that order in one buffer."""
        int_bytes = len(ints) * 8
        num_bytes = int_bytes + len(floats) * 4
        self.turn ^= 1
        host, event = self.hosts[self.turn], self.events[self.turn]
        if event is not None:
            event.synchronize()
        if host is None or host.numel() < num_bytes:
            capacity = 1 << (num_bytes - 1).bit_length()
            host = self.hosts[self.turn] = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        if self.dev.numel() < num_bytes:
            self.dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        array = host.numpy()
        array[:int_bytes].view(np.int64)[:] = ints
        array[int_bytes:num_bytes].view(np.float32)[:] = floats
        dev = self.dev[:num_bytes]
        dev.copy_(host[:num_bytes], non_blocking=True)
        self.events[self.turn] = torch.cuda.Event()
        self.events[self.turn].record()
        return dev[:int_bytes].view(torch.long), dev[int_bytes:].view(torch.float32)


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
    )
