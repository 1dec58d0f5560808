"""What every request to a tandem HTTP server passes before its handler: the API key and the size limit.

The engine (aiohttp) uses the middlewares here; the retrieval server (FastAPI) shares the key helpers.
Invariants: with a key set, every path except `/health` answers 401 unless the request carries
`Authorization: Bearer <key>` (SGLang's `--api-key` header), compared in constant time as bytes, so a
header that is not UTF-8 is a wrong key, never an error; the key is never written to a log or an error
message; a body over the limit is refused with 413 before it is read, so a large upload cannot hold the
event loop. A server binds its port before loading anything (`bind_socket`), so a port clash is the
first thing it reports, and it binds beyond loopback only with a key.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import secrets
import socket

from aiohttp import web

ENGINE_KEY_ENV = "TANDEM_ENGINE_API_KEY"  # read by `serve-engine` and by clients of external engines
SGLANG_KEY_ENV = "SGLANG_API_KEY"  # what an SGLang deployment's clients conventionally read
RETRIEVAL_KEY_ENV = "TANDEM_RETRIEVAL_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no key
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# the exit status of a server whose port is taken (Linux's EADDRINUSE): a launcher that picked the
# port itself (host/child_server.py) picks another and launches again
PORT_IN_USE_EXIT = 98


class PortInUseError(OSError):
    """host:port is bound by another socket."""


def new_api_key() -> str:
    """A fresh key for the servers one run launches (it lives only in their environment and memory). It
    begins with a letter: SGLang reads its `--config` file back as `--api-key VALUE` through argparse,
    which takes a value that begins with "-" for a flag and exits (token_urlsafe's would, 1 in 64)."""
    return "k" + secrets.token_urlsafe(32)


def key_from_env(*names: str) -> str | None:
    """The first non-empty environment variable of `names`, or None."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def is_authorized(header: str | None, api_key: str | None) -> bool:
    """Whether `header` is `Bearer <api_key>`. Servers decode raw header bytes with surrogateescape
    (aiohttp) or latin-1 (uvicorn); encoding back the same way gives the bytes the client sent."""
    if not api_key:
        return True
    if header is None:
        return False
    try:
        sent = header.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte sequence produced
        return False
    return hmac.compare_digest(sent, f"Bearer {api_key}".encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def open_beyond_loopback_message(command: str, host: str, what: str, key_flag_env: str) -> str:
    return (
        f"tandem {command}: --host {host} exposes {what} beyond this machine; pass --api-key (or set "
        f"${key_flag_env}) so only your clients can reach it, or bind a loopback address (127.0.0.1)"
    )


def bind_socket(host: str, port: int, command: str) -> socket.socket:
    """A listening TCP socket on host:port, bound before the server loads its model or index, so a
    port in use fails at once; raises OSError with one line naming the address and what to do."""
    if not 0 <= port <= 65535:
        raise OSError(f"tandem {command}: --port {port} is not a TCP port (0..65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(
            f"tandem {command}: --host {host!r} is not an address of this machine ({error.strerror})"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"tandem {command}: {host}:{port} is already in use (another server, or an earlier one "
                "still running); pick another --port"
            ) from None
        elif error.errno == errno.EADDRNOTAVAIL:
            why = "is not an address of this machine; pass one of its addresses as --host"
        else:
            why = f"cannot be bound ({error.strerror})"
        raise OSError(f"tandem {command}: {host}:{port} {why}") from None
    sock.set_inheritable(False)
    return sock


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
