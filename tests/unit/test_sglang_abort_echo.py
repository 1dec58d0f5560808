"""SGLang 0.5.15 answers the abort of a queued streamed request with an echo that does not follow
`--incremental-streaming-output`: its last output id only and every logprob so far, with the cumulative
`completion_tokens` (tokenizer_manager.py `_handle_abort_req`), and its chunk may be merged with deltas the
client has not read yet. The client keeps what it could pair and ends the piece as aborted (a retracted
request then goes again from there), where any other chunk whose counts do not add up is an error."""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.rollout.client import EngineClient, EngineError


def _chunk(ids, lps, total, reason=None):
    meta = {"completion_tokens": total, "output_token_logprobs": [[lp, 0, None] for lp in lps]}
    if reason:
        meta["finish_reason"] = {"type": reason}
    return {"output_ids": ids, "meta_info": meta}


def _stream_of(chunks):
    async def stream(path, body):
        for chunk in chunks:
            yield chunk

    return stream


def _collect(client: EngineClient):
    ids, logprobs, versions = [], [], []
    meta = asyncio.run(client._stream_tokens({"input_ids": [1]}, ids, logprobs, versions))
    return meta, ids, logprobs, versions


def test_an_abort_echo_merged_with_an_unread_delta_keeps_what_was_paired():
    client = EngineClient("http://127.0.0.1:1", kind="sglang")
    # two tokens delivered; then tokens 3-4 (unread delta) merged with the echo: ids [3, 4, 4], 4 logprobs
    client._stream = _stream_of(
        [_chunk([1, 2], [-0.1, -0.2], 2), _chunk([3, 4, 4], [-0.1, -0.2, -0.3, -0.4], 4, reason="abort")]
    )
    meta, ids, logprobs, versions = _collect(client)
    assert ids == [1, 2] and logprobs == [-0.1, -0.2] and len(versions) == 2
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 2


def test_counts_that_do_not_add_up_without_an_abort_are_an_error():
    client = EngineClient("http://127.0.0.1:1", kind="sglang")
    client._stream = _stream_of([_chunk([1, 2], [-0.1, -0.2], 2), _chunk([3, 4, 4], [-0.1, -0.2, -0.3], 4)])
    with pytest.raises(EngineError, match="stream chunk has 3 ids and 3 logprobs for 2 new tokens"):
        _collect(client)
