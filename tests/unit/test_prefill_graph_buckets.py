"""The host side of CUDA-graph prefill (engine/prefill_graphs.py, engine/attention_tiles.py), pure numpy:
the (sequence, query tile) table covers every query exactly once whatever the ragged lengths, fits the
slots a bucket reserves, and the buckets pick the smallest graph that holds a step. The graphs themselves
run in tests/gpu/test_engine_fast_paths.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandemrl.engine.attention_tiles import max_tiles, tile_table
from tandemrl.engine.prefill_graphs import MAX_GRAPH_TOKENS, MIN_GRAPH_TOKENS, pick_bucket, prefill_buckets


@pytest.mark.parametrize("queries_per_tile", [1, 5, 21, 64])
def test_tile_table_covers_every_query_once(queries_per_tile):
    rng = random.Random(queries_per_tile)
    for _ in range(50):
        query_lens = np.array([rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))], dtype=np.int64)
        num_slots = max_tiles(int(query_lens.sum()), len(query_lens), queries_per_tile)
        table = tile_table(query_lens, queries_per_tile, num_slots)
        assert table.shape == (num_slots, 2)
        used = table[table[:, 0] >= 0]
        assert (table[len(used) :] == -1).all()  # padding slots only after the real ones
        covered = {
            (seq, q)
            for seq, tile in used
            for q in range(tile * queries_per_tile, (tile + 1) * queries_per_tile)
        }
        wanted = {(seq, q) for seq, length in enumerate(query_lens) for q in range(length)}
        assert wanted <= covered  # every query of every sequence sits in a tile
        assert len(used) == len({tuple(row) for row in used})  # and no tile runs twice
        assert all(tile * queries_per_tile < query_lens[seq] for seq, tile in used)  # none is empty


def test_tile_table_refuses_too_few_slots():
    with pytest.raises(AssertionError, match="query tiles do not fit"):
        tile_table(np.array([10, 10]), 4, 5)  # 3 + 3 tiles


def test_buckets_double_to_the_budget_and_carry_fewer_sequences_than_tokens():
    buckets = prefill_buckets(8192, 256, 21)
    assert [b.num_tokens for b in buckets] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert all(
        b.num_seqs < b.num_tokens and b.num_seqs <= 256 for b in buckets
    )  # the last layer always prunes
    assert [b.num_seqs for b in buckets] == [64, 128, 256, 256, 256, 256, 256]
    assert all(b.num_tiles == max_tiles(b.num_tokens, b.num_seqs, 21) for b in buckets)
    # an odd budget is the top bucket; a huge one is capped (larger steps run eagerly)
    assert prefill_buckets(3000, 16, 8)[-1].num_tokens == 3000
    assert prefill_buckets(1 << 16, 16, 8)[-1].num_tokens == MAX_GRAPH_TOKENS
    assert [b.num_tokens for b in prefill_buckets(100, 4, 8)] == [100] and MIN_GRAPH_TOKENS > 100


def test_pick_bucket_is_the_smallest_that_holds_the_step():
    buckets = prefill_buckets(8192, 256, 21)
    assert pick_bucket(buckets, 1, 1).num_tokens == 128
    assert pick_bucket(buckets, 129, 3).num_tokens == 256
    assert pick_bucket(buckets, 2048, 40).num_tokens == 2048
    assert pick_bucket(buckets, 100, 100).num_tokens == 256  # 128 tokens carry at most 64 sequences
    assert pick_bucket(buckets, 8193, 1) is None  # past the largest: eager
    assert pick_bucket(buckets, 600, 257) is None  # more sequences than any bucket carries
