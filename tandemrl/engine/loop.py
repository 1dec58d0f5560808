"""The engine's loop thread: runs `Engine.step()` and, between steps, the commands the HTTP side queues.

Everything that touches the engine (new requests, aborts, pauses, weight loads) is a command run on
this thread, so a weight update can never land inside a step. Invariant: every submitted request's
`on_finish` callback runs exactly once, on this thread, with the finished sequence. `busy_s` counts
the seconds spent in `Engine.step()` (the engine had requests to run), never decreasing, so a reader
gets a busy fraction from two samples (`/get_server_info`, read at the runner's step boundaries).
`busy_for_s()` tells how long the thread has been inside one step or command, so `/health` can report
a blocked loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from tandemrl.engine.engine import Engine
from tandemrl.engine.sequence import SamplingParams, Sequence

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.is_paused = False
        self._commands: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable[[Sequence], None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # the part of busy_s in steps that launched a prefill
        self._busy_since: float | None = None  # monotonic start of the step or command running now
        self.busy_with = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[Engine], object], label: str = "") -> Future:
        """Run `fn(engine)` on the loop thread between two steps; the future holds its result. `label`
        names the command in a /health report while it runs."""
        future: Future = Future()
        if self.error is not None:
            future.set_exception(RuntimeError(f"engine loop died: {self.error!r}"))
        else:
            self._commands.put((fn, future, label or getattr(fn, "__name__", "command")))
        return future

    def busy_for_s(self) -> float:
        """Seconds the loop thread has spent in the step or command it is running now (0 when idle)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _mark_busy(self, what: str | None) -> None:
        self.busy_with = what or ""
        self._busy_since = None if what is None else time.monotonic()

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        extra: dict | None,
        on_finish: Callable[[Sequence], None],
    ) -> Future:
        """Queue a request; the future resolves once it is admitted (or raises ValueError if refused)."""

        def add(engine: Engine) -> None:
            engine.add_request(rid, prompt_ids, params, extra)
            self._callbacks[rid] = on_finish

        return self.call(add)

    def pause(self, mode: str) -> Future:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")

        submitted_s = time.monotonic()

        def do_pause(engine: Engine) -> dict:
            # where a pause's time goes on the engine: waiting for the loop thread (the step it was running
            # and the commands before it), then the step in flight drained
            taken_s = time.monotonic()
            self.is_paused = True
            engine.drain()  # the step in flight finishes now: its requests are answered before the pause
            timing = {"pause_queued_s": taken_s - submitted_s, "pause_drain_s": time.monotonic() - taken_s}
            if mode == "abort":
                aborted = engine.abort_all("aborted by pause_generation(mode=abort)")
                self._deliver(aborted)
                return {"num_aborted": len(aborted), **timing}
            if mode == "retract":
                return {"num_retracted": engine.retract_all(), **timing}
            return {"num_running": len(engine.scheduler.running), **timing}

        return self.call(do_pause)

    def resume(self) -> Future:
        def do_resume(engine: Engine) -> None:
            self.is_paused = False

        return self.call(do_resume)

    def abort(self, rid: str | None) -> Future:
        """Abort one request, or all when `rid` is None; does not pause the engine."""

        def do_abort(engine: Engine) -> int:
            if rid is None:
                finished = engine.abort_all("aborted by abort_request(abort_all)")
            else:
                seq = engine.abort(rid)
                finished = [seq] if seq is not None else []
            self._deliver(finished)
            return len(finished)

        return self.call(do_abort)

    def _deliver(self, finished: list[Sequence]) -> None:
        for seq in finished:
            callback = self._callbacks.pop(seq.rid, None)
            assert callback is not None, f"request {seq.rid} finished twice or was never submitted"
            try:
                callback(seq)
            except Exception:  # a broken client must not stop the engine
                logger.exception("on_finish callback failed for %s", seq.rid)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future, label = item
            if future.set_running_or_notify_cancel():
                result, error = None, None
                self._mark_busy(label)
                try:
                    result = fn(self.engine)
                except BaseException as raised:  # reported to the caller, the loop carries on
                    error = raised
                self._mark_busy(None)
                # A command that drained the step in flight answers the requests it finished first.
                self._deliver(self.engine.take_finished())
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        profile = StepProfile.from_env()
        try:
            while not self._stop.is_set():
                if profile is not None:
                    profile.tick(self.engine.num_steps)
                is_idle = self.is_paused or not self.engine.has_work()
                self._run_commands(block=is_idle)
                if not self.is_paused and self.engine.has_work():
                    start_s = time.perf_counter()
                    self._mark_busy("a generation step")
                    finished = self.engine.step()
                    self._mark_busy(None)
                    step_s = time.perf_counter() - start_s
                    self.busy_s += step_s
                    if self.engine.last_step_kind == "prefill":
                        self.prefill_busy_s += step_s
                    self._deliver(finished)
        except BaseException as error:
            logger.exception("engine loop crashed")
            self.error = error
            self._deliver(self.engine.abort_all(f"engine loop crashed: {error!r}"))
            raise


class StepProfile:
    """`TANDEM_ENGINE_PROFILE=PATH:FIRST:COUNT`: cProfile of the loop thread from engine step FIRST for COUNT
    steps, its stats written to PATH (a diagnostic for benchmarks: where a step's host time goes in a real
    run, commands and HTTP hand-offs included; the profiler slows the steps it records)."""

    def __init__(self, path: str, first: int, count: int):
        import cProfile

        self.path, self.first, self.last = path, first, first + count
        self.profiler = cProfile.Profile()
        self.state = "waiting"

    @classmethod
    def from_env(cls) -> StepProfile | None:
        import os

        spec = os.environ.get("TANDEM_ENGINE_PROFILE")
        if not spec:
            return None
        path, first, count = spec.rsplit(":", 2)
        return cls(path, int(first), int(count))

    def tick(self, num_steps: int) -> None:
        if self.state == "waiting" and num_steps >= self.first:
            self.state = "recording"
            self.profiler.enable()
        elif self.state == "recording" and num_steps >= self.last:
            self.profiler.disable()
            self.state = "done"
            self.profiler.dump_stats(self.path)
            logger.info("engine profile of steps %d-%d written to %s", self.first, self.last, self.path)
