"""Prefix reuse: full KV blocks are kept, keyed by the tokens they hold, and shared by later requests.

The agent resends its whole context every turn, so turn t+1 starts with turn t's tokens. As soon as a
request's block is full (its tokens known, its K/V computed) it is registered under a hash chained over
all tokens up to the block's end (so a block matches only behind the same prefix); the hashes are kept on
the sequence (`Sequence.block_hashes`), so each is computed once, after the step that filled the block,
while the GPU runs the next one, and a finishing request only releases its blocks. A later request whose
leading tokens hash the same points its block table at those blocks and starts with them cached. Blocks
are reference counted; an unreferenced cached block stays in an LRU pool until a fresh allocation needs
it, so a retracted request's registered blocks may serve its own re-admission, as SGLang's radix cache does.
Across weight updates (`rollout.engine.prefix_cache_max_age`: a run derives 1 in async, 0 in sync): every
weight update that changes the version starts a new epoch, and a sequence's K/V is as old as the oldest K/V in
its table (`Sequence.kv_epoch`: the epoch of its first computed block, or of the oldest block it matched;
every later block attends to those). A cached block carries its chain's epoch, and serves a match while at
most `max_age` epochs old; older ones are forgotten at the update. It is the approximation `in_place` pausing
already makes for the running requests' K/V (kept across an update), extended to K/V that waits in the cache,
and bounded: with age 1 a trajectory that waits on a search across one update reuses its context instead of
prefilling it again, and nothing older than the previous weights is ever reused. Age 0 is exact: no K/V of
older weights serves a new request or a next turn.

Invariants: a shared block is never written (a match always leaves at least one token to compute, and
new tokens land in blocks after the matched ones); a block is matched only while its epoch is within
`max_age` of the current one, and a table whose K/V is older than that is never registered again
(`num_registered_blocks`); a speculative draft's K/V is never registered (`register` stops at the known
tokens, which a draft is not part of until accepted, and the blocks past the accepted tokens are released
unregistered).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import Sequence, Status
from tandemrl.engine.speculative import NgramDrafter

_ROOT_HASH = 0
_NEVER = sys.maxsize  # `Sequence.num_registered_blocks` of a table that must not be cached any further


class PrefixCachingBlockManager(BlockManager):
    """`max_age`: epochs (weight updates) a cached block may serve for after the one it was computed in."""

    def __init__(self, num_blocks: int, block_size: int, max_age: int = 0):
        super().__init__(num_blocks, block_size)
        self.max_age = max_age
        self.ref_counts = [0] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.block_epoch: dict[int, int] = {}  # cached block -> the epoch of the oldest K/V in its chain
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.epoch = 0
        self.num_stale_hit_tokens = 0  # matched tokens whose K/V came from earlier weights

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
            del self.block_epoch[block]
        self.ref_counts[block] = 1
        return block

    def match_prefix(self, seq: Sequence) -> int:
        """Point an uncached sequence's empty table at cached blocks of its leading tokens; returns the
        tokens hit."""
        if seq.block_table or seq.num_cached_tokens:
            return 0
        size, epoch = self.block_size, self.epoch
        seq.kv_epoch = epoch  # a fresh table: as new as these weights, or as old as the oldest block matched
        for index in range((seq.num_known_tokens - 1) // size):  # leave >= 1 token to compute (for logits)
            block = self.hash_to_block.get(self._hashes(seq, index + 1)[index])
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            block_epoch = self.block_epoch[block]
            if block_epoch < epoch:
                self.num_stale_hit_tokens += size
            seq.kv_epoch = min(seq.kv_epoch, block_epoch)
        seq.num_cached_tokens = len(seq.block_table) * size
        seq.num_registered_blocks = len(seq.block_table)  # a new table: the matched blocks are cached
        return seq.num_cached_tokens

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """`seq.block_hashes`, extended to cover its first `num_blocks` blocks (of known tokens)."""
        hashes, size = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            ids = seq.all_ids
            parent = hashes[-1] if hashes else _ROOT_HASH
            for index in range(len(hashes), num_blocks):
                parent = hash((parent, tuple(ids[index * size : (index + 1) * size])))
                hashes.append(parent)
        return hashes

    def register(self, seq: Sequence) -> None:
        """Cache `seq`'s full blocks whose K/V is computed (its step launched) and whose tokens are known,
        each once. The engine calls this for every step while the GPU computes it, so a block is shared
        about one step after it is full (vLLM caches full blocks too) and a finishing request has at most
        its last block left to hash."""
        start = seq.num_registered_blocks
        end = min(seq.num_cached_tokens, seq.num_known_tokens) // self.block_size
        if end <= start:
            return
        if seq.kv_epoch < self.epoch - self.max_age:  # its K/V is older than a match may be, from here on
            seq.num_registered_blocks = _NEVER
            return
        hashes, table = self._hashes(seq, end), seq.block_table
        for index in range(start, end):
            block = table[index]
            block_hash = hashes[index]
            # skip a block cached already (it was matched) or content cached in another block
            if block not in self.block_hash and block_hash not in self.hash_to_block:
                self.hash_to_block[block_hash] = block
                self.block_hash[block] = block_hash
                self.block_epoch[block] = seq.kv_epoch
        seq.num_registered_blocks = end

    def free(self, block_table: list[int]) -> None:
        """Release a table: its cached blocks wait in the LRU pool once unreferenced, the others are free."""
        ref_counts, cached = self.ref_counts, self.block_hash
        for block in block_table:  # 8,192 blocks when a batch of 256 x 512 tokens ends: keep it lean
            count = ref_counts[block] - 1
            assert count >= 0, f"block {block} freed twice"
            ref_counts[block] = count
            if not count:
                if block in cached:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        block_table.clear()

    def next_epoch(self, epochs: int = 1) -> None:
        """The weights changed: forget the cached blocks that are now more than `max_age` epochs old (those
        in use stay with their tables, unmatchable; the tables holding them are never registered again).
        `epochs` > `max_age` forgets everything (the weights went back to an older version)."""
        self.epoch += epochs
        oldest = self.epoch - self.max_age
        for block in [b for b, block_epoch in self.block_epoch.items() if block_epoch < oldest]:
            del self.hash_to_block[self.block_hash.pop(block)]
            del self.block_epoch[block]
            if block in self.evictable:
                del self.evictable[block]
                self.free_blocks.append(block)

    def reset(self) -> None:
        assert all(count == 0 for count in self.ref_counts), "flush with blocks in use"
        self.next_epoch(self.max_age + 1)
        super().reset()


class PrefixCachingScheduler(Scheduler):
    """The scheduler that counts prefix hits and registers each running request's full blocks after every
    step and at its finish (the base scheduler matches each request as it is admitted, through
    `blocks.match_prefix`)."""

    blocks: PrefixCachingBlockManager

    def __init__(
        self,
        blocks: PrefixCachingBlockManager,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefill_delay_steps: int = 0,
        drafter: NgramDrafter | None = None,
    ):
        super().__init__(blocks, max_running_requests, max_prefill_tokens, prefill_delay_steps, drafter)
        self.num_prefix_hit_tokens = 0

    def _prefill_batch(self) -> list[Sequence]:
        continuing = self.prefilling
        batch = super()._prefill_batch()
        # An admitted request's cached tokens are its prefix hit (its step has not run yet).
        self.num_prefix_hit_tokens += sum(s.num_cached_tokens for s in batch if s is not continuing)
        return batch

    def after_step(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status is Status.RUNNING:
                self.blocks.register(seq)

    def finish(self, seq: Sequence, reason: dict) -> None:
        if seq.status is Status.RUNNING:
            self.blocks.register(seq)  # the blocks its last steps filled
        super().finish(seq, reason)
