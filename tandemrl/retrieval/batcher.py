"""Micro-batching: concurrent /retrieve requests share one encoder call and one Qdrant batch query.

Requests enter an asyncio queue; a single batching task takes the first waiting request, gathers the
ones that arrive within `max_wait_s` (up to `max_batch_queries` queries), and runs the whole batch on one
worker thread. Invariant: exactly one thread ever touches the retriever (Qdrant local mode and the
encoder are not thread-safe), and every submitted request's future is resolved — with hits or with the
batch's exception — so no request hangs and no failure stops the batching task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandemrl.retrieval.store import Hit

log = logging.getLogger(__name__)

SearchFn = Callable[[list[str], list[int]], list[list[Hit]]]


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future


class MicroBatcher:
    def __init__(self, search: SearchFn, max_batch_queries: int = 256, max_wait_s: float = 0.002):
        self._search = search
        self.max_batch_queries = max_batch_queries
        self.max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")
        self.num_batches = 0
        self.num_queries = 0

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
        await self._queue.put(_Pending(queries, topk, future))
        return await future

    async def _loop(self) -> None:
        while True:
            batch = await self._collect()
            try:
                await self._run(batch)
            except Exception as error:  # keep serving: fail this batch's requests, not the server
                log.exception("retrieval batch of %d requests failed", len(batch))
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(error)

    async def _collect(self) -> list[_Pending]:
        assert self._queue is not None
        batch = [await self._queue.get()]
        num_queries = len(batch[0].queries)
        deadline = time.monotonic() + self.max_wait_s
        while num_queries < self.max_batch_queries:
            remaining = deadline - time.monotonic()
            try:
                pending = (
                    self._queue.get_nowait()
                    if remaining <= 0
                    else await asyncio.wait_for(self._queue.get(), remaining)
                )
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            batch.append(pending)
            num_queries += len(pending.queries)
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        queries = [query for pending in batch for query in pending.queries]
        topks = [pending.topk for pending in batch for _ in pending.queries]
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self._search, queries, topks)
        self.num_batches += 1
        self.num_queries += len(queries)
        start = 0
        for pending in batch:
            end = start + len(pending.queries)
            if not pending.future.done():  # the client may have gone away (cancelled future)
                pending.future.set_result(results[start:end])
            start = end
