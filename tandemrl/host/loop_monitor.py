"""How long an asyncio event loop was held, and by what: the driver's loop runs every agent loop, the
runner and its bookkeeping; an engine server's loop answers every request. A callback that holds the loop
delays every response waiting behind it, which the trajectories see as HTTP time (`rollout/traj/http_s`).

`LoopMonitor.start()` (on the loop) runs a task that sleeps `interval_s` again and again: how much later
than asked it wakes is time the loop spent on other callbacks (`late_s`). A watcher thread checks the
task's heartbeat every `interval_s`; while it is older than `stall_s`, the loop's thread is held by one
callback (or a queue of them), and the watcher samples that thread's stack (`sys._current_frames`):
the innermost frame of this repository is charged one `interval_s` (`where`), so a window's `where`
names the code that held the loop and roughly for how long. Sampling is in-process and costs a wake-up
per `interval_s` on each side.

Invariant: `take()` returns the window since the last `take()` and starts a new one; `totals()` is
cumulative (never decreases), for readers that take deltas (an engine's `/get_server_info`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])  # the tandemrl package: frames charged to a stall


def _holder(frame) -> str:
    """`file:line function` of the innermost frame of tandemrl in a stack (else the innermost frame)."""
    innermost = frame
    while frame is not None:
        if frame.f_code.co_filename.startswith(_REPO):
            break
        frame = frame.f_back
    frame = frame or innermost
    path = frame.f_code.co_filename
    short = path[len(_REPO) - len("tandemrl") :] if path.startswith(_REPO) else Path(path).name
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


class LoopMonitor:
    def __init__(self, interval_s: float = 0.01, stall_s: float = 0.05):
        self.interval_s, self.stall_s = interval_s, stall_s
        self._lock = threading.Lock()
        self._heartbeat = time.monotonic()
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._late_s = self._stalled_s = 0.0  # cumulative
        self._window_late_s = self._window_stalled_s = self._window_max_late_s = 0.0
        self._window_wakes = 0
        self._where: Counter[str] = Counter()

    def start(self) -> None:
        """Start watching the running loop (call from a coroutine on it)."""
        self._loop_thread = threading.get_ident()
        self._heartbeat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-monitor")
        self._watcher = threading.Thread(target=self._watch, name="loop-monitor", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            self._watcher.join(timeout=1)

    async def _tick(self) -> None:
        while True:
            asked_s = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now_s = time.monotonic()
            late_s = max(0.0, now_s - asked_s - self.interval_s)
            with self._lock:
                self._heartbeat = now_s
                self._late_s += late_s
                self._window_late_s += late_s
                self._window_max_late_s = max(self._window_max_late_s, late_s)
                self._window_wakes += 1

    def _watch(self) -> None:
        last_s = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now_s = time.monotonic()
            with self._lock:
                held_s = now_s - self._heartbeat
            # the stall's time since this thread last looked (it may itself have waited for a core or the GIL)
            charged_s = min(now_s - last_s, held_s - self.stall_s - self.interval_s)
            last_s = now_s
            if charged_s <= 0:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            with self._lock:
                self._stalled_s += charged_s
                self._window_stalled_s += charged_s
                if frame is not None:
                    self._where[_holder(frame)] += charged_s

    def take(self, top: int = 5) -> dict:
        """The window since the last `take()`: `late_s` (the timer's lateness summed), `max_late_ms`,
        `stalled_s` (how long the loop was held past `stall_s` at a stretch) and `where` (the `top` code
        locations that held it, seconds each)."""
        with self._lock:
            window = {
                "late_s": self._window_late_s,
                "max_late_ms": 1000 * self._window_max_late_s,
                "stalled_s": self._window_stalled_s,
                "wakes": self._window_wakes,
                "where": dict(self._where.most_common(top)),
            }
            self._window_late_s = self._window_stalled_s = self._window_max_late_s = 0.0
            self._window_wakes = 0
            self._where.clear()
        return window

    def totals(self) -> dict[str, float]:
        """Cumulative seconds the loop ran its timer late, and was held past `stall_s`."""
        with self._lock:
            return {"loop_late_s": self._late_s, "loop_stalled_s": self._stalled_s}
