"""The tile shapes of the Triton attention kernels (engine/triton_attention.py, engine/triton_decode.py) and
the candidates `kernel_tuning` times at start-up. Pure Python: the tuning cache (engine/tuning_cache.py)
reads and writes them on machines without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DecodeConfig:
    """How decode attention runs: one program per (sequence, KV head), or split over the context."""

    split: bool
    block_n: int
    num_warps: int
    partition: int = 0  # context tokens per program when split
    num_stages: int = 3  # software pipelining depth of the K/V loads (Triton's default is 3)


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of the ragged kernel when steps carry many queries per sequence: `block_m` rows (queries x
    the GQA group) per program, `block_n` keys per iteration."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


DEFAULT_PREFILL = PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3)
PREFILL_CANDIDATES = (
    DEFAULT_PREFILL,
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 128, 8, 2),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(128, 32, 8, 3),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(128, 64, 4, 3),
)
DEFAULT_DECODE = DecodeConfig(split=False, block_n=64, num_warps=4)
DECODE_CANDIDATES = (
    DEFAULT_DECODE,
    DecodeConfig(False, 32, 4),
    DecodeConfig(False, 32, 2),
    DecodeConfig(False, 64, 2),
    DecodeConfig(False, 64, 4, num_stages=2),
    DecodeConfig(False, 64, 4, num_stages=4),
    DecodeConfig(False, 64, 8),
    DecodeConfig(False, 128, 4),
    DecodeConfig(False, 128, 8),
    DecodeConfig(True, 64, 4, 128),
    DecodeConfig(True, 64, 4, 256),
    DecodeConfig(True, 128, 4, 512),
)


def tile_table(query_lens: np.ndarray, queries_per_tile: int, num_slots: int) -> np.ndarray:
    """The (sequence, query tile) pairs of a prefill step, in order, padded with (-1, -1) to `num_slots`
    rows: the grid of `triton_attention.attend_tiles`. A sequence of q new tokens has ceil(q / queries per
    tile) tiles, so `max_tiles` slots always suffice."""
    counts = -(-query_lens // queries_per_tile)
    total = int(counts.sum())
    assert total <= num_slots, f"{total} query tiles do not fit {num_slots} slots"
    table = np.full((num_slots, 2), -1, dtype=np.int64)
    table[:total, 0] = np.repeat(np.arange(len(query_lens)), counts)
    table[:total, 1] = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return table


def max_tiles(num_tokens: int, num_seqs: int, queries_per_tile: int) -> int:
    """The most query tiles `num_seqs` sequences of `num_tokens` new tokens in all can need: each
    sequence's last tile may be partial, so one more per sequence than the tokens fill."""
    return -(-num_tokens // queries_per_tile) + num_seqs
