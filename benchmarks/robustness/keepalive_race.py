"""The keep-alive race behind "Connection reset by peer" on launched vLLM (docs/RELIABILITY.md row 25), on a real
uvicorn server: bursts of concurrent requests from one aiohttp pool, each burst after an idle gap close to
uvicorn's 5 s keep-alive, with aiohttp's default pool (connections kept 15 s) and with ours
(host/http_pool.py, 4 s). Counts the requests that failed on a connection the server was closing.

    python -m benchmarks.robustness.keepalive_race [--rounds 24] [--burst 256] [--out ...]

The server is uvicorn at its defaults (timeout_keep_alive 5 s, as vLLM 0.24 and SGLang run it) in a process
of its own, answering every POST with a small JSON body.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks import write_json
from tandemrl.host.http_pool import KEEPALIVE_S, UVICORN_KEEPALIVE_S, pooled_connector

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=24, help="bursts per pool (default 24)")
    p.add_argument("--burst", type=int, default=256, help="concurrent requests a burst (default 256)")
    p.add_argument("--port", type=int, default=18731)
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "robustness" / "keepalive_race.json")
    )
    return p.parse_args()


def gaps(rounds: int) -> list[float]:
    """Idle gaps spread over 4.90-5.10 s, where a request and uvicorn's close can meet."""
    return [UVICORN_KEEPALIVE_S - 0.10 + 0.20 * i / max(rounds - 1, 1) for i in range(rounds)]


async def bursts(url: str, make_connector, args) -> dict:
    errors: dict[str, int] = {}
    sent = 0
    async with aiohttp.ClientSession(connector=make_connector()) as session:

        async def one() -> None:
            nonlocal sent
            sent += 1
            try:
                async with session.post(url, json={}) as resp:
                    await resp.read()
            except aiohttp.ClientError as error:
                errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1

        await asyncio.gather(*(one() for _ in range(args.burst)))  # fills the pool
        for gap in gaps(args.rounds):
            await asyncio.sleep(gap)
            await asyncio.gather(*(one() for _ in range(args.burst)))
    return {"requests": sent, "failed": sum(errors.values()), "errors": errors}


def wait_for_port(port: int, server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Return once the server accepts connections on `port`; raise if it exits or takes over `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {server.returncode} before it listened") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not listen on {port} in {timeout_s:g} s") from None
            time.sleep(0.2)


def main() -> None:
    args = parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(args.port)])
    url = f"http://127.0.0.1:{args.port}/generate"
    try:
        wait_for_port(args.port, server)
        pools = {
            "aiohttp_default_15s": lambda: aiohttp.TCPConnector(limit=0),
            f"tandem_{KEEPALIVE_S:g}s": lambda: pooled_connector(0),
        }
        report = {
            "server": f"uvicorn defaults (timeout_keep_alive {UVICORN_KEEPALIVE_S:g} s)",
            "workload": f"{args.rounds} bursts of {args.burst} concurrent POSTs, idle gaps "
            f"{gaps(args.rounds)[0]:.2f}-{gaps(args.rounds)[-1]:.2f} s",
            "pools": {},
        }
        for name, make in pools.items():
            start = time.perf_counter()
            result = asyncio.run(bursts(url, make, args))
            result["seconds"] = time.perf_counter() - start
            report["pools"][name] = result
            print(f"{name}: {result}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=10)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
