"""Load on an engine process for benchmarks that share its GPU: a client process keeping /generate
requests in flight, and a private MPS daemon to run under.

The client is a separate process so its host work does not share the benchmarked process's GIL (in a
run the rollout clients live apart from the trainer). Requests that end are logged as "finish-time
tokens error" lines to a file the benchmark reads while it grows, so rates over any window of
`time.perf_counter()` (one clock for both processes on Linux) come from finished requests.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import tempfile
import time
from pathlib import Path


class GenerationLoad:
    """A client process (so its host work does not share the actor's GIL, as in a run where rollout
    clients live apart from the trainer) keeping `concurrency` /generate requests in flight: random
    prompts, fixed-length answers; it appends "finish-time tokens" lines to a file read here."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        max_new_tokens: int,
        vocab: int,
        prompt_len: int,
        api_key: str | None = None,
    ):
        ctx = multiprocessing.get_context("spawn")
        self.path = Path(tempfile.mkdtemp(prefix="tandem-bench-load-")) / "done.txt"
        self.path.touch()
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_load_main,
            args=(url, concurrency, max_new_tokens, vocab, prompt_len, str(self.path), self._stop, api_key),
            daemon=True,
        )

    def __enter__(self) -> GenerationLoad:
        self._proc.start()
        deadline = time.perf_counter() + 300
        while not self.records():  # the child imports torch and connects before any request ends
            if time.perf_counter() > deadline or not self._proc.is_alive():
                raise RuntimeError(f"generation load finished no request (exit code {self._proc.exitcode})")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._proc.join(timeout=120)
        if self._proc.is_alive():
            self._proc.kill()

    def records(self) -> list[tuple[float, int, str]]:
        out = []
        for line in self.path.read_text().splitlines():
            t, n, err = line.split(" ", 2)
            out.append((float(t), int(n), err))
        return out

    def tokens_per_s(self, start: float, end: float) -> float:
        return sum(n for t, n, _ in self.records() if start <= t < end) / max(end - start, 1e-9)

    def rate_over(self, window_s: float) -> float:
        start = time.perf_counter()
        time.sleep(window_s)
        return self.tokens_per_s(start, time.perf_counter())

    def errors(self) -> list[str]:
        return [err for _, _, err in self.records() if err != "-"]


def _load_main(url, concurrency, max_new_tokens, vocab, prompt_len, path, stop, api_key) -> None:
    asyncio.run(_load(url, concurrency, max_new_tokens, vocab, prompt_len, path, stop, api_key))


async def _load(url, concurrency, max_new_tokens, vocab, prompt_len, path, stop, api_key) -> None:
    from tandemrl.rollout.client import EngineClient

    client = EngineClient(url, api_key=api_key)
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    with open(path, "a", buffering=1) as out:  # line-buffered: the parent reads it while it grows

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                try:
                    result = await client.generate(prompt, params)
                    out.write(f"{time.perf_counter()} {len(result.output_ids)} -\n")
                except Exception as exc:  # reported in the JSON; the load must not die silently
                    out.write(f"{time.perf_counter()} 0 {repr(exc)[:300]!r}\n")
                    await asyncio.sleep(0.5)

        try:
            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        finally:
            await client.close()
