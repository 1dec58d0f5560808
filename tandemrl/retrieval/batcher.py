"""Micro-batching: concurrent /retrieve requests share one encoder call and one Qdrant batch query.

Requests enter an asyncio queue; a single batching task gathers the requests that arrive within
`max_wait_s` and runs batches of up to `max_batch_queries` queries on one worker thread. A batch takes
at most `max_slice_queries` queries from each request, round robin, so a small request is served in
the next batch even while a large one is being worked through. Invariants: exactly one thread ever touches
the retriever (Qdrant local mode and the encoder are not thread-safe); every submitted request's future
is resolved — with its hits or with its own error — so no request hangs, no failure stops the batching
task, and a query that makes the search raise fails only its own request (a failed batch is retried
request by request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tandemrl.retrieval.store import Hit

log = logging.getLogger(__name__)

SearchFn = Callable[[list[str], list[int]], list[list[Hit]]]


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future
    hits: list[list[Hit]] = field(default_factory=list)  # for queries[:len(hits)]
    submitted_s: float = field(default_factory=time.monotonic)

    @property
    def num_left(self) -> int:
        return len(self.queries) - len(self.hits)


class MicroBatcher:
    def __init__(
        self,
        search: SearchFn,
        max_batch_queries: int = 256,
        max_wait_s: float = 0.002,
        max_slice_queries: int = 64,
    ):
        self._search = search
        self.max_batch_queries = max_batch_queries
        self.max_wait_s = max_wait_s
        self.max_slice_queries = max_slice_queries
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._active: list[_Pending] = []  # requests with queries left, in arrival order
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")
        self.num_batches = 0
        self.num_queries = 0
        self.num_failed_requests = 0
        # cumulative, for /health: seconds the search thread worked, and query-seconds waited from a
        # request's arrival to the start of the batch that served each of its queries
        self.busy_s = 0.0
        self.queue_wait_s = 0.0

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop(), name="retrieval-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, queries: list[str], topk: int) -> list[list[Hit]]:
        assert self._queue is not None, "MicroBatcher.start() was not awaited"
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(list(queries), topk, future))
        return await future

    async def _loop(self) -> None:
        while True:
            await self._collect()
            batch = self._next_batch()
            try:
                await self._run(batch)
            except Exception as error:  # keep serving: retry alone, so a bad query fails only its request
                if len(batch) == 1:
                    self._fail(batch[0][0], error)
                else:
                    log.warning("retrieval batch of %d requests failed; retrying them one by one", len(batch))
                    for pending, start, end in batch:
                        await self._run_alone(pending, start, end)
            # round robin: the requests just served go to the back, so waiting ones are next
            served = [pending for pending, _, _ in batch]
            waiting = [p for p in self._active if all(p is not s for s in served)]
            self._active = [p for p in waiting + served if p.num_left and not p.future.done()]

    async def _collect(self) -> None:
        """Move newly arrived requests to the active list (waiting for one when there is none)."""
        assert self._queue is not None
        if not self._active:
            self._active.append(await self._queue.get())
        deadline = time.monotonic() + self.max_wait_s
        while sum(p.num_left for p in self._active) < self.max_batch_queries:
            remaining = deadline - time.monotonic()
            try:
                pending = (
                    self._queue.get_nowait()
                    if remaining <= 0
                    else await asyncio.wait_for(self._queue.get(), remaining)
                )
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            self._active.append(pending)
        while not self._queue.empty():  # requests that came while the last batch ran join this round
            self._active.append(self._queue.get_nowait())

    def _next_batch(self) -> list[tuple[_Pending, int, int]]:
        """(request, start, end) slices: at most max_slice_queries per request, max_batch_queries in all."""
        batch, num_queries = [], 0
        for pending in self._active:
            if pending.future.done():  # the client went away
                continue
            start = len(pending.hits)
            take = min(pending.num_left, self.max_slice_queries, self.max_batch_queries - num_queries)
            if take <= 0:
                break
            batch.append((pending, start, start + take))
            num_queries += take
        return batch

    async def _search_in_thread(self, queries: list[str], topks: list[int]) -> list[list[Hit]]:
        loop = asyncio.get_running_loop()
        start_s = time.monotonic()
        try:
            results = await loop.run_in_executor(self._executor, self._search, queries, topks)
        finally:
            self.busy_s += time.monotonic() - start_s
        self.num_batches += 1
        self.num_queries += len(queries)
        return results

    async def _run(self, batch: list[tuple[_Pending, int, int]]) -> None:
        queries = [q for pending, start, end in batch for q in pending.queries[start:end]]
        topks = [pending.topk for pending, start, end in batch for _ in range(start, end)]
        now_s = time.monotonic()
        self.queue_wait_s += sum(
            (now_s - pending.submitted_s) * (end - start) for pending, start, end in batch
        )
        results = await self._search_in_thread(queries, topks)
        offset = 0
        for pending, start, end in batch:
            self._accept(pending, results[offset : offset + end - start])
            offset += end - start

    async def _run_alone(self, pending: _Pending, start: int, end: int) -> None:
        try:
            self._accept(
                pending,
                await self._search_in_thread(pending.queries[start:end], [pending.topk] * (end - start)),
            )
        except Exception as error:
            self._fail(pending, error)

    def _fail(self, pending: _Pending, error: Exception) -> None:
        log.warning("retrieval failed for a request of %d queries: %s", len(pending.queries), error)
        self.num_failed_requests += 1
        if not pending.future.done():
            pending.future.set_exception(error)

    def _accept(self, pending: _Pending, hits: list[list[Hit]]) -> None:
        pending.hits.extend(hits)
        if not pending.num_left and not pending.future.done():  # done: the client may have gone away
            pending.future.set_result(pending.hits)
