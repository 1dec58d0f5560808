"""`retract` on SGLang, realised by the client: in-flight requests come back with the tokens generated so
far, wait in the client while the engine is paused, and go back with those tokens appended to the
prompt once it continues; the engine's cache is flushed in between, so all their KV is recomputed under
the new weights.

Why not SGLang's own `retract` mode: it moves running requests to the scheduler's waiting queue, keeps
their prefixes in the radix cache, and SGLang flushes that cache only when no request is queued or
running (`Scheduler.flush_cache`; an update sent with `flush_cache: true` then fails its assert and the
scheduler dies). So a retracted request would re-prefill on KV cached under the old weights. Here the
pause uses SGLang's `abort` mode, which empties the engine, the update is followed by a flush that
succeeds, and the client holds every request (returned or new) until `continue_generation`.

Invariant: a request is resubmitted only when a retract pause began after it was sent and neither it
nor all requests were aborted by the caller (also while it waited), so a caller's abort still ends it;
it is resubmitted under a rid of its own (`resent_rid`), to which the caller's abort is forwarded.
"""

from __future__ import annotations

import asyncio


class RetractGate:
    """Open unless a retract pause is under way; counts those pauses and the caller's own aborts."""

    def __init__(self) -> None:
        self.num_retracts = 0
        self.num_abort_all = 0
        self.aborted_rids: set[str] = set()
        self.is_paused = False
        self._open: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _event(self) -> asyncio.Event:
        # an Event belongs to one loop; a client reused under a new loop gets a new one in the same state
        loop = asyncio.get_running_loop()
        if self._open is None or self._loop is not loop:
            self._open, self._loop = asyncio.Event(), loop
            if not self.is_paused:
                self._open.set()
        return self._open

    def close(self) -> None:
        """Before the pause request: requests sent from now on wait, those in flight will come back."""
        self.num_retracts += 1
        self.is_paused = True
        self._event().clear()

    def open(self) -> None:
        """After `continue_generation` answered."""
        self.is_paused = False
        self._event().set()

    async def wait_open(self) -> None:
        await self._event().wait()

    def mark(self) -> tuple[int, int]:
        """What a request records when it is sent, for `is_retracted`."""
        return self.num_retracts, self.num_abort_all

    def is_retracted(self, marked: tuple[int, int], rid: str | None) -> bool:
        """Whether an abort of the request sent at `marked` came from a retract pause (not the caller)."""
        num_retracts, num_abort_all = marked
        return (
            self.num_retracts != num_retracts
            and self.num_abort_all == num_abort_all
            and (rid is None or rid not in self.aborted_rids)
        )


def resent_rid(rid: str, attempt: int) -> str:
    """The rid of a retracted request's `attempt`-th resubmission: its own, so that SGLang's abort of the
    earlier stream's rid misses it, and not starting with the caller's (SGLang's scheduler aborts every
    rid that starts with the one it is given)."""
    return f"retry{attempt}-{rid}"


def resumed_body(body: dict, output_ids: list[int]) -> dict:
    """The request again, with the tokens it already generated appended to its prompt and counted
    against its token limits."""
    params = dict(body.get("sampling_params") or {})
    params["max_new_tokens"] = int(params.get("max_new_tokens", 128)) - len(output_ids)
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(output_ids))
    return {**body, "input_ids": list(body["input_ids"]) + list(output_ids), "sampling_params": params}
