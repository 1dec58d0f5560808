"""Continuous batching: which requests run in the next step, and who gets retracted when memory runs out.

A step is either a prefill step (newly admitted or retracted requests, all their uncached tokens, up to
`max_prefill_tokens`) or a decode step (one token for every running request), as in nano-vllm.
Invariants: at most `max_running_requests` run at once; a running request always holds the blocks for
its next token; a running request whose pending token is its last (`Sequence.can_grow`) is not
scheduled again, it only waits for that token to be read; a retracted request goes back to the front of
the waiting queue with its generated tokens and no KV, so it is re-prefilled over prompt + output when
it is admitted again.
"""

from __future__ import annotations

from collections import deque

from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running_requests: int, max_prefill_tokens: int):
        self.blocks = blocks
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences, is_prefill); empty when nothing can run."""
        batch = self._admit()
        if batch:
            return batch, True
        return self._decode_batch(), False

    def _admit(self) -> list[Sequence]:
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_running_requests:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_cached_tokens
            assert not seq.num_pending, "a waiting request's tokens are all known"
            if batch and num_tokens + num_new > self.max_prefill_tokens:
                break
            if not self.blocks.can_allocate(seq.block_table, seq.num_tokens):
                break
            self.blocks.allocate(seq.block_table, seq.num_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            batch.append(seq)
            num_tokens += num_new
        self.running.extend(batch)
        return batch

    def _decode_batch(self) -> list[Sequence]:
        """Make room for one more token per running request, retracting the newest when out of blocks."""
        index, batch, block_size = 0, [], self.blocks.block_size
        while index < len(self.running):
            seq = self.running[index]
            if not seq.can_grow:
                index += 1
                continue
            num_tokens = seq.num_tokens
            if len(seq.block_table) * block_size < num_tokens:  # the next token opens a new block
                if not self.blocks.can_allocate(seq.block_table, num_tokens):
                    victim = self.running.pop()  # the newest request loses its KV first
                    self._to_waiting(victim)
                    self.num_preemptions += 1  # the victim sat at or after `index`: not in `batch`
                    continue
                self.blocks.allocate(seq.block_table, num_tokens)
            batch.append(seq)
            index += 1
        return batch

    def _to_waiting(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.num_cached_tokens = 0
        seq.num_retractions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def retract_all(self) -> int:
        """Move every running request back to the waiting queue (KV dropped, tokens kept, order kept)."""
        running, self.running = self.running, []
        for seq in reversed(running):
            self._to_waiting(seq)
        return len(running)

    def finish(self, seq: Sequence, reason: dict) -> None:
        """Remove `seq` from whichever queue holds it and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status, seq.finish_reason = Status.FINISHED, reason
