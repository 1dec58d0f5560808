"""Shared by the engine unit tests (overlapped steps, speculative decoding, chunked prefill): serving a
batch of requests to completion on an in-process `Engine`, with the checks every such run must pass."""

from __future__ import annotations

from collections.abc import Callable

from tandemrl.engine.engine import Engine
from tandemrl.engine.sequence import SamplingParams, Sequence

Work = dict[str, tuple[list[int], SamplingParams]]  # request id -> (prompt ids, sampling parameters)


def serve(
    engine: Engine, work: Work, step: Callable[[Engine], list[Sequence]] | None = None
) -> dict[str, Sequence]:
    """Add every request of `work`, then step the engine until it is idle (`step`: one engine step in
    place of `engine.step()`, e.g. one that also records what it forwarded). Each request finishes exactly
    once, none is left behind, and every KV block is free again; returns the finished sequences by id."""
    for rid, (ids, params) in work.items():
        engine.add_request(rid, ids, params)
    done: dict[str, Sequence] = {}
    while engine.has_work():
        for seq in engine.step() if step is None else step(engine):
            assert seq.rid not in done, f"{seq.rid} finished twice"
            done[seq.rid] = seq
    assert set(done) == set(work) and not engine.requests
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "blocks leaked"
    return done
