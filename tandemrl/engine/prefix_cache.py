"""Prefix reuse: full KV blocks are kept, keyed by the tokens they hold, and shared by later requests.

The agent resends its whole context every turn, so turn t+1 starts with turn t's tokens. When a request
finishes, each of its full blocks is registered under a hash chained over all tokens up to the block's
end (so a block matches only behind the same prefix); a later request whose leading tokens hash the same
points its block table at those blocks and starts with them cached. Blocks are reference counted; an
unreferenced cached block stays in an LRU pool until a fresh allocation needs it.
Invariants: a shared block is never written (a match always leaves at least one token to compute, and
new tokens land in blocks after the matched ones); KV computed under older weights is never matched:
`invalidate()` (on a weight update) forgets every hash and marks the blocks still in use as stale, and a
stale block, or any block after it in a table, is never registered. Retraction frees without registering:
retracted KV is dropped deliberately.
"""

from __future__ import annotations

from collections import OrderedDict

from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import Sequence, Status

_ROOT_HASH = 0


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.ref_counts = [0] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.stale: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_hash)

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free_blocks

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        missing = self.blocks_needed(num_tokens) - len(block_table)
        assert missing <= self.num_free_blocks, "caller must check can_allocate first"
        for _ in range(missing):
            block_table.append(self._take())

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)  # evict the least recently used cached block
            del self.hash_to_block[self.block_hash.pop(block)]
        self.ref_counts[block] = 1
        return block

    def match_prefix(self, seq: Sequence) -> int:
        """Point an uncached sequence's empty table at cached blocks of its leading tokens; returns tokens hit."""
        if seq.block_table or seq.num_cached_tokens:
            return 0
        ids, size = seq.all_ids, self.block_size
        parent = _ROOT_HASH
        for index in range((len(ids) - 1) // size):  # leave >= 1 token to compute (its logits are needed)
            parent = hash((parent, tuple(ids[index * size : (index + 1) * size])))
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_cached_tokens = len(seq.block_table) * size
        return seq.num_cached_tokens

    def free(self, block_table: list[int], cached_ids: list[int] | None = None) -> None:
        """Release a table; with `cached_ids` (the tokens whose KV it holds) its full blocks are kept cached."""
        size, parent = self.block_size, _ROOT_HASH
        register = cached_ids is not None
        for index, block in enumerate(block_table):
            register = register and block not in self.stale and (index + 1) * size <= len(cached_ids)
            if register:
                parent = hash((parent, tuple(cached_ids[index * size : (index + 1) * size])))
                self._register(block, parent)
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.stale.discard(block)
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        block_table.clear()

    def _register(self, block: int, block_hash: int) -> None:
        if block in self.block_hash or block_hash in self.hash_to_block:
            return  # already cached (it was matched), or the same content is cached in another block
        self.hash_to_block[block_hash] = block
        self.block_hash[block] = block_hash

    def invalidate(self) -> None:
        """Forget all cached content (weights changed); blocks in use become stale, never to be registered."""
        self.stale.update(b for b, count in enumerate(self.ref_counts) if count > 0)
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.hash_to_block.clear()
        self.block_hash.clear()

    def reset(self) -> None:
        assert all(count == 0 for count in self.ref_counts), "flush with blocks in use"
        self.invalidate()
        super().reset()


class PrefixCachingScheduler(Scheduler):
    """The scheduler that counts prefix hits and registers a finished request's blocks (the base scheduler
    matches each request as it is admitted, through `blocks.match_prefix`)."""

    blocks: PrefixCachingBlockManager

    def __init__(self, blocks: PrefixCachingBlockManager, max_running_requests: int, max_prefill_tokens: int):
        super().__init__(blocks, max_running_requests, max_prefill_tokens)
        self.num_prefix_hit_tokens = 0

    def _prefill_batch(self) -> list[Sequence]:
        continuing = self.prefilling
        batch = super()._prefill_batch()
        # An admitted request's cached tokens are its prefix hit (its step has not run yet).
        self.num_prefix_hit_tokens += sum(s.num_cached_tokens for s in batch if s is not continuing)
        return batch

    def finish(self, seq: Sequence, reason: dict) -> None:
        if seq.status is Status.RUNNING:
            self.blocks.free(seq.block_table, seq.all_ids[: seq.num_cached_tokens])
        super().finish(seq, reason)

    def invalidate_prefix_cache(self) -> None:
        self.blocks.invalidate()
