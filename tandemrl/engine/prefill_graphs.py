"""CUDA-graph prefill for the fast runner (engine/fast_model_runner.py): one captured prefill step (forward
*and* sampler) per token bucket, replayed for the smallest bucket that holds the step.

Why: an eager prefill step launches about nine kernels a layer from Python, and for a small model the
host takes far longer to enqueue them than the GPU takes to run them (SmolLM2-135M on the H200: about 30
ms a prefill step on the host for about 2 ms of kernels, more than half of the engine's busy time in a
training run; docs/DESIGN.md, Sharing a GPU). Every running request waits through every prefill step.

How a ragged step fits a fixed graph: the step's tokens are padded to the bucket's `num_tokens` (ids 0, no
pending id, position 0, slot -1: a padding token writes no K/V) and its sequences to `num_seqs` (query
and context length 0: a padding sequence attends to nothing and its sampled row is ignored). The
attention's grid is a table of (sequence, query tile) pairs sized for the bucket
(`attention_tiles.tile_table`, `triton_attention.attend_tiles`), padded with (-1, -1), so the ragged
lengths are data, not launch shapes. A bucket carries fewer sequences than tokens (`num_seqs` <=
`num_tokens` / 2), so the forward always prunes its last layer to each sequence's last token
(`fast_layers.fast_forward`). Steps past the largest bucket, with more sequences than it carries, with
drafts or with longer block tables run eagerly. Weight updates copy into the parameters in place and the
KV cache never moves, so the graphs stay valid, as the decode graphs do (engine/cuda_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tandemrl.engine.attention_tiles import max_tiles, tile_table
from tandemrl.engine.cuda_graphs import capture_graphs
from tandemrl.engine.model_runner import flatten_uncached
from tandemrl.engine.sequence import Sequence

logger = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = 128
# Past this a prefill step's kernels outlast its launches even for small models, and a larger bucket's
# activations would stay reserved in the graphs' memory pool: such steps run eagerly.
MAX_GRAPH_TOKENS = 8192


@dataclass(frozen=True)
class Bucket:
    num_tokens: int
    num_seqs: int
    num_tiles: int


def prefill_buckets(max_prefill_tokens: int, max_batch: int, queries_per_tile: int) -> list[Bucket]:
    """Token buckets from `MIN_GRAPH_TOKENS`, doubling, up to the prefill budget (capped at
    `MAX_GRAPH_TOKENS`); each carries up to half as many sequences (and at most `max_batch`)."""
    top = min(max_prefill_tokens, MAX_GRAPH_TOKENS)
    sizes, size = [], MIN_GRAPH_TOKENS
    while size < top:
        sizes.append(size)
        size *= 2
    sizes.append(top)
    buckets = []
    for num_tokens in sizes:
        num_seqs = max(1, min(max_batch, num_tokens // 2))
        buckets.append(Bucket(num_tokens, num_seqs, max_tiles(num_tokens, num_seqs, queries_per_tile)))
    return buckets


def pick_bucket(buckets: list[Bucket], num_tokens: int, num_seqs: int) -> Bucket | None:
    """The smallest bucket that holds `num_tokens` tokens of `num_seqs` sequences, None if none does."""
    return next((b for b in buckets if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs), None)


class _Layout:
    """Offsets of the static int64 inputs, sized for the largest bucket: ids | pending rows | positions |
    slots (per token) | query starts | query lengths | context lengths | last-token indices (per sequence)
    | seed | tile table | block tables; then float32 temperatures (per sequence)."""

    def __init__(self, num_tokens: int, num_seqs: int, num_tiles: int, width: int):
        t, s = num_tokens, num_seqs
        self.t, self.s, self.n, self.width = t, s, num_tiles, width
        self.ids, self.src, self.pos, self.slots = 0, t, 2 * t, 3 * t
        self.qstart, self.qlens, self.ctx, self.last = 4 * t, 4 * t + s, 4 * t + 2 * s, 4 * t + 3 * s
        self.seed = 4 * t + 4 * s
        self.tiles = self.seed + 1
        self.tables = self.tiles + 2 * num_tiles
        self.num_ints = self.tables + s * width
        self.num_bytes = self.num_ints * 8 + s * 4


class PrefillGraphs:
    """One captured prefill step (forward + sampling) per token bucket, sharing static inputs and one pool."""

    def __init__(
        self,
        forward,
        kv_caches: list[torch.Tensor],
        tokens_B: torch.Tensor,
        logprobs_B: torch.Tensor,
        max_blocks_per_seq: int,
        block_size: int,
        max_prefill_tokens: int,
        queries_per_tile: int,
        decode_config,
        prefill_config,
        embed_weight: torch.Tensor,
    ):
        self.forward, self.kv_caches, self.block_size = forward, kv_caches, block_size
        self.tokens_B, self.logprobs_B, self.embed_weight = tokens_B, logprobs_B, embed_weight
        self.decode_config, self.prefill_config = decode_config, prefill_config
        self.queries_per_tile, self.width = queries_per_tile, max_blocks_per_seq
        self.buckets = prefill_buckets(max_prefill_tokens, tokens_B.shape[0], queries_per_tile)
        top = self.buckets[-1]
        self.max_seqs = max(b.num_seqs for b in self.buckets)
        self.layout = lay = _Layout(
            top.num_tokens, self.max_seqs, max(b.num_tiles for b in self.buckets), self.width
        )
        device = tokens_B.device
        # Two pinned host buffers take turns (engine/pinned_staging.py's invariant): the one filled for a
        # step was last copied two launches back, which the engine has read since.
        self.hosts = [torch.zeros(lay.num_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.turn = 0
        self.dev = torch.zeros(lay.num_bytes, dtype=torch.uint8, device=device)
        self.ints = self.dev[: lay.num_ints * 8].view(torch.long)
        self.temps = self.dev[lay.num_ints * 8 :].view(torch.float32)
        self.num_replays = 0
        self._capture()

    def _views(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        lay, ints = self.layout, self.ints
        t, s, n = bucket.num_tokens, bucket.num_seqs, bucket.num_tiles

        def part(start: int, length: int) -> torch.Tensor:
            return ints[start : start + length]

        return {
            "ids": part(lay.ids, t),
            "src": part(lay.src, t),
            "pos": part(lay.pos, t),
            "slots": part(lay.slots, t),
            "qstart": part(lay.qstart, s),
            "qlens": part(lay.qlens, s),
            "ctx": part(lay.ctx, s),
            "last": part(lay.last, s),
            "seed": part(lay.seed, 1),
            "tiles": part(lay.tiles, 2 * lay.n).view(lay.n, 2)[:n],
            "tables": part(lay.tables, lay.s * lay.width).view(lay.s, lay.width)[:s],
            "temps": self.temps[:s],
        }

    def _step(self, bucket: Bucket) -> torch.Tensor:
        """The captured work: embed (pending ids read on the device), forward, sample into tokens_B."""
        from tandemrl.engine.fast_layers import embed_pending
        from tandemrl.engine.gpu_sampler import fused_sample
        from tandemrl.engine.triton_attention import FastMetadata

        v = self._views(bucket)
        meta = FastMetadata(
            slot_mapping_T=v["slots"],
            query_start_B=v["qstart"],
            query_lens_B=v["qlens"],
            context_lens_B=v["ctx"],
            block_tables_BW=v["tables"],
            last_token_index=v["last"],
            max_query_len=2,  # any prefill: the ragged path, over the tile table
            block_size=self.block_size,
            max_context_len=self.width * self.block_size,
            decode=self.decode_config,
            prefill=self.prefill_config,
            tiles_N2=v["tiles"],
        )
        embeds = embed_pending(v["src"], self.tokens_B, v["ids"], self.embed_weight)
        logits = self.forward(None, v["pos"], self.kv_caches, meta, 1, embeds)
        s = bucket.num_seqs
        fused_sample(logits, v["temps"], v["seed"], self.tokens_B[:s], self.logprobs_B[:s])
        return logits

    @torch.inference_mode()
    def _capture(self) -> None:
        lay, ints = self.layout, self.ints
        ints.zero_()  # no tokens, no keys: lengths 0
        ints[lay.src : lay.src + lay.t].fill_(-1)  # no pending ids
        ints[lay.slots : lay.slots + lay.t].fill_(-1)  # warm-up and capture write no K/V
        ints[lay.tiles : lay.tiles + 2 * lay.n].fill_(-1)  # and attend nowhere
        self.temps.fill_(1.0)
        self.graphs, self.logits = capture_graphs(self.buckets, self._step)
        logger.info("captured prefill CUDA graphs for token buckets %s", [b.num_tokens for b in self.buckets])

    def bucket_for(self, seqs: list[Sequence]) -> Bucket | None:
        """The bucket this prefill step replays, None where it runs eagerly."""
        if len(seqs) > self.max_seqs:
            return None
        num_tokens = 0
        for seq in seqs:
            if seq.draft_ids or len(seq.block_table) > self.width:
                return None
            num_tokens += seq.step_end - seq.num_cached_tokens
        return pick_bucket(self.buckets, num_tokens, len(seqs))

    def run(
        self, bucket: Bucket, seqs: list[Sequence], src_rows: list[int], temps: list[float], seed: int
    ) -> torch.Tensor:
        """Replay `bucket`'s step for these sequences; returns their logits `[B, V]` (a static buffer's view)."""
        lay, bs = self.layout, self.block_size
        input_ids, positions, query_lens, context_lens = flatten_uncached(seqs)
        num_tokens, num_seqs = len(input_ids), len(seqs)
        t, s = bucket.num_tokens, bucket.num_seqs
        self.turn ^= 1
        host = self.hosts[self.turn]
        h = host[: lay.num_ints * 8].view(torch.long).numpy()
        qlens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        starts = np.cumsum(qlens) - qlens
        ends = starts + qlens - 1
        tables = h[lay.tables : lay.tables + lay.s * lay.width].reshape(lay.s, lay.width)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        pos = np.asarray(positions, dtype=np.int64)
        owner = np.repeat(np.arange(num_seqs), qlens)
        h[lay.ids : lay.ids + num_tokens] = input_ids
        h[lay.ids + num_tokens : lay.ids + t] = 0
        h[lay.src : lay.src + t] = -1  # padding tokens and known ids: no pending row
        for i, row in enumerate(src_rows):
            if row >= 0:  # the sequence's last input is the token the last step sampled into `row`
                h[lay.src + ends[i]] = row
        h[lay.pos : lay.pos + num_tokens] = pos
        h[lay.pos + num_tokens : lay.pos + t] = 0
        h[lay.slots : lay.slots + num_tokens] = tables[owner, pos // bs] * bs + pos % bs
        h[lay.slots + num_tokens : lay.slots + t] = -1  # padding tokens write no K/V
        for offset, values, pad in (
            (lay.qstart, starts, num_tokens),
            (lay.qlens, qlens, 0),
            (lay.ctx, ctx, 0),  # padding sequences attend to nothing
            (lay.last, ends, 0),
        ):
            h[offset : offset + num_seqs] = values
            h[offset + num_seqs : offset + s] = pad
        h[lay.seed] = seed
        tiles = tile_table(qlens, self.queries_per_tile, bucket.num_tiles)
        h[lay.tiles : lay.tiles + tiles.size] = tiles.ravel()
        host_temps = host[lay.num_ints * 8 :].view(torch.float32).numpy()
        host_temps[:num_seqs] = temps
        host_temps[num_seqs:s] = 1.0
        self.dev.copy_(host, non_blocking=True)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:num_seqs]
