"""Shared by the engine integration tests: weights that force one token, and HTTP and stream helpers."""

from __future__ import annotations

import asyncio
import time

import torch
from safetensors.torch import load_file

FORCED_TOKEN = 42


def hf_state_dict(model_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name, as a trainer's `state_dict()` would name them."""
    return load_file(str(model_dir / "model.safetensors"))


def forcing_state_dict(model_dir, token_id: int = FORCED_TOKEN) -> dict[str, torch.Tensor]:
    """Weights under which every next token is `token_id`, whatever the context.

    Attention and MLP outputs are zeroed, so the final hidden state is the (normed) embedding of the
    current token; every embedding row is e_0 except `token_id`'s, which is 100 e_0, so with tied
    embeddings the logit of `token_id` exceeds every other by ~99 * sqrt(hidden).
    """
    state = {k: v.clone() for k, v in hf_state_dict(model_dir).items()}
    embed = state["model.embed_tokens.weight"]
    embed.zero_()
    embed[:, 0] = 1.0
    embed[token_id, 0] = 100.0
    for name, tensor in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
    return state


async def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.02):
    """Poll an async predicate until it returns a truthy value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise TimeoutError("condition not met in time")


def record_streams(client) -> list[list[dict]]:
    """Wrap an HTTP client's SSE reader (`_stream`, the real one) so every chunk of each stream is also
    appended, as it arrives, to a list of that stream's own; returns those lists (one per stream, in call
    order). When a test sees a chunk there, the client has already taken its tokens in (a chunk is handed
    on within the same task), so the weight version they were stamped with is settled."""
    streams: list[list[dict]] = []
    read = client._stream

    async def recorded(path: str, body: dict):
        chunks: list[dict] = []
        streams.append(chunks)
        async for chunk in read(path, body):
            chunks.append(chunk)
            yield chunk

    client._stream = recorded
    return streams
