"""What every request to a tandem HTTP server passes before its handler: the API key and the size limit.

The engine (aiohttp) uses the middlewares here; the retrieval server (FastAPI) shares the key helpers.
Invariants: with a key set, every path except `/health` answers 401 unless the request carries
`Authorization: Bearer <key>` (SGLang's `--api-key` header), compared in constant time; the key is
never written to a log or an error message; a body over the limit is refused with 413 before it is
read, so a large upload cannot hold the event loop.
"""

from __future__ import annotations

import hmac
import os
import secrets

from aiohttp import web

ENGINE_KEY_ENV = "TANDEM_ENGINE_API_KEY"  # read by `serve-engine` and by clients of external engines
SGLANG_KEY_ENV = "SGLANG_API_KEY"  # what an SGLang deployment's clients conventionally read
RETRIEVAL_KEY_ENV = "TANDEM_RETRIEVAL_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no key
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def new_api_key() -> str:
    """A fresh key for the servers one run launches (it lives only in their environment and memory)."""
    return secrets.token_urlsafe(32)


def key_from_env(*names: str) -> str | None:
    """The first non-empty environment variable of `names`, or None."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def is_authorized(header: str | None, api_key: str | None) -> bool:
    if not api_key:
        return True
    expected = f"Bearer {api_key}".encode()
    return header is not None and hmac.compare_digest(header.encode(), expected)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unauthorized_message(path: str) -> str:
    return (
        f"{path} needs the server's API key: send the header 'Authorization: Bearer <key>' (the key given "
        f"to the server by --api-key or ${ENGINE_KEY_ENV})"
    )


def too_large_message(num_bytes: int | None, max_bytes: int) -> str:
    size = "a body of unknown size" if num_bytes is None else f"{num_bytes} bytes"
    return f"request body too large: {size}, the limit is {max_bytes} bytes; split the request"


def guard_middlewares(api_key: str | None, max_request_bytes: int) -> list:
    """aiohttp middlewares: API key first (a stranger learns nothing, not even the size limit)."""

    @web.middleware
    async def check_key(request: web.Request, handler):
        if request.path not in OPEN_PATHS and not is_authorized(
            request.headers.get("Authorization"), api_key
        ):
            message = unauthorized_message(request.path)
            return web.json_response(
                {"success": False, "message": message, "error": {"message": message}}, status=401
            )
        return await handler(request)

    @web.middleware
    async def check_size(request: web.Request, handler):
        length = request.content_length
        if length is not None and length > max_request_bytes:
            return _too_large(length, max_request_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # a chunked body that outgrew client_max_size while read
            return _too_large(None, max_request_bytes)

    return [check_key, check_size]


def _too_large(num_bytes: int | None, max_bytes: int) -> web.Response:
    message = too_large_message(num_bytes, max_bytes)
    return web.json_response(
        {"success": False, "message": message, "error": {"message": message}}, status=413
    )
