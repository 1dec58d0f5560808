"""The paged KV cache: a pool of fixed-size blocks shared by all requests, plus per-request block tables.

Invariant: a block belongs to at most one request at a time; a request's block table covers exactly
ceil(num_cached_tokens / block_size) blocks, and freed blocks return to the pool at once. Prefix reuse
(`prefix_cache.PrefixCachingBlockManager`) subclasses this with reference counts and content hashes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandemrl.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_table) <= len(self.free_blocks)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it can hold `num_tokens` tokens."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        assert missing <= len(self.free_blocks), "caller must check can_allocate first"
        for _ in range(missing):
            block_table.append(self.free_blocks.popleft())

    def trim(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks of `block_table` past those `num_tokens` tokens need (a rejected draft's)."""
        tail = block_table[self.blocks_needed(num_tokens) :]
        if tail:
            del block_table[-len(tail) :]
            self.free(tail)

    def match_prefix(self, seq: Sequence) -> int:
        """Tokens of `seq` whose KV the pool already holds: none here (`PrefixCachingBlockManager` finds
        them)."""
        return 0

    def free(self, block_table: list[int]) -> None:
        self.free_blocks.extend(block_table)
        block_table.clear()

    def reset(self) -> None:
        """Forget every allocation (used by flush_cache when no request holds blocks)."""
        assert len(self.free_blocks) == self.num_blocks, "flush with blocks in use"
        self.free_blocks = deque(range(self.num_blocks))


def kv_bytes_per_token(cfg: dict, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * element


def allocate_kv_caches(
    cfg: dict, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One `[2, num_slots, num_kv_heads, head_dim]` tensor per layer (zeros: padded gathers stay finite)."""
    shape = (2, num_blocks * block_size, cfg["num_kv_heads"], cfg["head_dim"])
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg["num_layers"])]
