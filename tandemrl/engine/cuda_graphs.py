"""CUDA-graph decode for the fast runner (engine/fast_model_runner.py): one captured decode step (forward
*and* sampler) per batch size, replayed for the smallest captured size >= the batch. Padding rows write no
KV and attend to nothing. Weight updates copy into the parameters in place, so captured graphs stay valid
across them. A sequence's pending input token is read on the device, from the rows the previous step
sampled into (`tokens_B`), so step n+1 can be launched before the host has seen step n's tokens.
"""

from __future__ import annotations

import logging

import torch

from tandemrl.engine.pinned_staging import HostInputs
from tandemrl.engine.sequence import Sequence

# Triton is imported only on the CUDA path (`triton_attention`, `fast_layers`): CPU installs need not have it.

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, 2, 4, 8, max_batch} | set(range(16, max_batch + 1, 16))
    return sorted(s for s in sizes if s <= max_batch)


def graph_size(sizes: list[int], num_seqs: int) -> int | None:
    """The captured batch size a decode batch of `num_seqs` rows runs at (padded up), None past the largest."""
    return next((s for s in sizes if s >= num_seqs), None)


def capture_graphs(keys: list, step) -> tuple[dict, dict]:
    """One CUDA graph of `step(key)` per key, each run once on a side stream first (warm-up), captured from
    the last key to the first into one memory pool (keys in ascending size: the smaller graphs fit in the
    largest's pool); returns (graphs, the captured outputs) by key. Decode and prefill graphs both use it."""
    graphs, outputs, pool = {}, {}, None
    for key in reversed(keys):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[key] = step(key)
        pool = graph.pool()
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, outputs


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
        self.inputs = HostInputs(self.max_batch, max_blocks_per_seq, device)
        self.rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        self.ones = torch.ones(self.max_batch, dtype=torch.long, device=device)
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
        self.graphs, self.logits = capture_graphs(self.sizes, self._step)
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
