"""A streamed generate request whose connection breaks before the server answers goes again, at most
UNANSWERED_RETRIES times (rollout/client.py `_open_stream`); the last failure is raised as it came. The
server is a fake vLLM on a real socket: it answers /v1/models, and resets the connection (SO_LINGER 0, an
RST, as a server closing an idle keep-alive connection does) for the first `resets` completion requests
before it streams one token."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import aiohttp
import pytest

from tandemrl.rollout.client import UNANSWERED_RETRIES
from tandemrl.rollout.vllm_client import VllmClient


class ResettingVllm:
    """A fake vLLM HTTP server that resets its first `resets` completion requests unanswered."""

    def __init__(self, resets: int):
        self.resets, self.completions = resets, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            (
                int(line.split(":")[1])
                for line in head.split("\r\n")
                if line.lower().startswith("content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        if head.startswith("GET /v1/models"):
            self.reply(writer, "application/json", json.dumps({"data": [{"id": "m"}]}))
        else:
            self.completions += 1
            if self.completions <= self.resets:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            chunk = {
                "choices": [
                    {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
                ]
            }
            self.reply(writer, "text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")
        await writer.drain()
        writer.close()

    @staticmethod
    def reply(writer: asyncio.StreamWriter, content_type: str, text: str) -> None:
        body = text.encode()
        writer.write(
            f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + body
        )


async def generate_against(fake: ResettingVllm):
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = VllmClient(f"http://127.0.0.1:{port}")
    try:
        return await client.generate([1, 2, 3], {"max_new_tokens": 1})
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def test_a_request_reset_before_any_answer_goes_again():
    assert UNANSWERED_RETRIES >= 1
    fake = ResettingVllm(resets=UNANSWERED_RETRIES)
    result = asyncio.run(generate_against(fake))
    assert result.output_ids == [7] and result.output_logprobs == [-0.5]
    assert fake.completions == UNANSWERED_RETRIES + 1


def test_the_last_reset_is_raised_as_it_came():
    fake = ResettingVllm(resets=UNANSWERED_RETRIES + 1)
    with pytest.raises(aiohttp.ClientConnectionError):
        asyncio.run(generate_against(fake))
    assert fake.completions == UNANSWERED_RETRIES + 1
