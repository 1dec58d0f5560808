"""Continuous batching: which requests run in the next step, and who gets retracted when memory runs out.

A step is either a prefill step or a decode step (one token for every running request done with its
prefill), as in nano-vllm. Prefill is chunked, as in SGLang and vLLM: a prefill step forwards at most
`max_prefill_tokens` tokens, first the rest of the request the step before left partially prefilled,
then requests admitted from the waiting queue in order; the one that overruns the budget gets what is
left of it (`Sequence.chunk_end`, a chunk samples nothing) and goes on in the next prefill step.
Which step runs: prefill first, except that a prefill step that leaves a partially prefilled request is
followed by a decode step whenever a running request can decode, so a long prompt's chunks alternate
with decode steps instead of stalling them; and that with `prefill_delay_steps` N > 0, requests that
wait for admission are held for up to N decode steps, so one prefill step takes more of them (like
vLLM's `scheduler_delay_factor`, counted in steps). A prefill step costs many decode steps where it runs
eagerly (docs/DESIGN.md, Sharing a GPU), and every running request waits through it. Held requests are
admitted at once when they would fill a prefill step (`max_prefill_tokens`, or every free running
slot) or when no running request can decode.
Invariants: at most `max_running_requests` run at once; at most one request is partially prefilled
(`prefilling`: only the last request of a prefill step can be cut, and it leads the next one); it holds
the blocks of all its tokens, allocated at admission, and is never in a decode batch; a running request
always holds the blocks for its next token; a running request whose pending token is its last
(`Sequence.can_grow`) is not scheduled again, it only waits for that token to be read; a retracted
request goes back to the front of the waiting queue with its generated tokens and no KV, so it is
re-prefilled from its first token (prompt + output) when it is admitted again.
"""

from __future__ import annotations

from collections import deque

from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.sequence import Sequence, Status
from tandemrl.engine.speculative import NgramDrafter


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefill_delay_steps: int = 0,
        drafter: NgramDrafter | None = None,
    ):
        self.blocks = blocks
        self.drafter = drafter
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_delay_steps = prefill_delay_steps
        self.num_held_steps = 0  # decode steps run since the last prefill step while requests waited
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None  # the running request cut short by the last prefill step
        self.is_decode_due = False  # the last step was a chunk: decode the others before the next one
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def after_step(self, seqs: list[Sequence]) -> None:
        """Called with a launched step's sequences before its tokens are read (the engine calls it while
        the GPU computes them): bookkeeping on the tokens known so far (prefix reuse caches blocks here)."""

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences, is_prefill); empty when nothing can run."""
        if self.is_decode_due:
            self.is_decode_due = False
            batch = self._decode_batch()
            if batch:
                return batch, False
        if self._holds_admissions():
            batch = self._decode_batch()
            if batch:
                self.num_held_steps += 1
                return batch, False
        batch = self._prefill_batch()
        if batch:
            self.num_held_steps = 0
            self.is_decode_due = self.prefilling is not None
            return batch, True
        return self._decode_batch(), False

    def schedule_step(self) -> tuple[list[Sequence], bool]:
        """`schedule()`, with drafts added to a decode batch when the engine speculates."""
        batch, is_prefill = self.schedule()
        if self.drafter is not None and not is_prefill:
            self._add_drafts(batch)
        return batch, is_prefill

    def _add_drafts(self, batch: list[Sequence]) -> None:
        """Give each request of a decode batch a draft to verify, with blocks for it where the pool has them
        free. After the batch is made: a draft never retracts a request (retraction is as without
        speculation).
        A draft is cut so every token the step may emit fits `max_new_tokens` and the context."""
        block_size = self.blocks.block_size
        for seq in batch:
            room = min(
                seq.params.max_new_tokens - len(seq.output_ids) - seq.num_pending,
                seq.max_total_len - seq.num_tokens,
            )
            draft = self.drafter.propose(seq, room - 1)  # the step emits up to len(draft) + 1 tokens
            if not draft:
                continue
            num_tokens = seq.num_tokens + len(draft)
            # free blocks only: a draft evicts no cached prefix block (the block manager would, for it)
            if self.blocks.blocks_needed(num_tokens) - len(seq.block_table) <= len(self.blocks.free_blocks):
                self.blocks.allocate(seq.block_table, num_tokens)
            else:  # only what the blocks held already
                draft = draft[: len(seq.block_table) * block_size - seq.num_tokens]
            seq.draft_ids = draft

    def after_verify(self, seq: Sequence, num_accepted: int) -> None:
        """A verify step accepted `num_accepted` draft tokens: their K/V is kept, the rest is released."""
        seq.num_cached_tokens += num_accepted
        seq.draft_ids = []
        self.blocks.trim(seq.block_table, seq.num_cached_tokens)

    def _holds_admissions(self) -> bool:
        """Whether the waiting requests wait one more decode step (`prefill_delay_steps`)."""
        if not self.waiting or self.prefilling is not None or self.num_held_steps >= self.prefill_delay_steps:
            return False
        free_slots = self.max_running_requests - len(self.running)
        if len(self.waiting) >= free_slots:
            return False  # the next prefill step admits as many as it can anyway
        num_tokens = 0
        for seq in self.waiting:  # stops once the held requests fill a prefill step
            num_tokens += seq.num_tokens
            if num_tokens >= self.max_prefill_tokens:
                return False
        return True

    def _prefill_batch(self) -> list[Sequence]:
        """The partially prefilled request's next chunk, then admissions, within `max_prefill_tokens`."""
        batch: list[Sequence] = []
        budget = self.max_prefill_tokens
        if self.prefilling is not None:
            seq, self.prefilling = self.prefilling, None
            budget -= self._schedule_chunk(seq, budget)
            batch.append(seq)
        while budget and self.waiting and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            # A decode batch runs before this in the same call only if the last step left a partial request
            # and the batch came out empty: retraction empties none while that request runs (it is the
            # newest, so the first victim, and its blocks make room), and if it was aborted or retracted
            # since, the engine drained first. So no request retracted with a pending token gets here.
            assert not seq.num_pending, "a waiting request's tokens are all known"
            # Matched only when next in line: a request left waiting holds no blocks (so it never keeps
            # old-weight KV across an update, nor the blocks the requests ahead of it need).
            self.blocks.match_prefix(seq)
            if not self.blocks.can_allocate(seq.block_table, seq.num_tokens):
                self.blocks.free(seq.block_table)
                seq.num_cached_tokens = 0
                break
            self.blocks.allocate(seq.block_table, seq.num_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._schedule_chunk(seq, budget)
            batch.append(seq)
        return batch

    def _schedule_chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule up to `budget` of `seq`'s uncached tokens (a request cut short is `prefilling`)."""
        num_new = seq.num_tokens - seq.num_cached_tokens
        if num_new <= budget:
            return num_new
        seq.chunk_end = seq.num_cached_tokens + budget
        self.prefilling = seq
        return budget

    def _decode_batch(self) -> list[Sequence]:
        """Make room for one more token per running request, retracting the newest when out of blocks."""
        index, batch, block_size = 0, [], self.blocks.block_size
        while index < len(self.running):
            seq = self.running[index]
            if not seq.can_grow or seq is self.prefilling:
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
        if seq is self.prefilling:
            self.prefilling = None
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
        if seq is self.prefilling:
            self.prefilling = None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status, seq.finish_reason = Status.FINISHED, reason
