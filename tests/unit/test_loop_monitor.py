"""tandemrl/host/loop_monitor.py: a callback that holds an event loop is seen, measured and named."""

from __future__ import annotations

import asyncio
import time

from tandemrl.host.loop_monitor import LoopMonitor


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop's thread, as a synchronous file write would be


async def _watched(monitor: LoopMonitor) -> tuple[dict, dict, dict, dict]:
    monitor.start()
    await asyncio.sleep(0.05)
    monitor.take()  # the start-up's window
    hold_the_loop(0.4)
    await asyncio.sleep(0.05)  # the timer wakes, late
    held, totals_after_hold = monitor.take(), monitor.totals()
    await asyncio.sleep(0.05)
    quiet = monitor.take()
    monitor.stop()
    return held, totals_after_hold, quiet, monitor.totals()


def test_a_blocking_call_is_measured_and_named():
    monitor = LoopMonitor(interval_s=0.01, stall_s=0.05)
    held, totals_after_hold, quiet, totals = asyncio.run(_watched(monitor))
    # the timer asked for 10 ms and woke after the 400 ms hold: at least 390 ms late, whatever the load
    assert held["max_late_ms"] >= 390 and held["late_s"] >= 0.39
    assert 0 < held["stalled_s"] <= 0.4
    assert any("hold_the_loop" in where for where in held["where"]), held["where"]
    assert not any("hold_the_loop" in where for where in quiet["where"])  # a new window
    assert totals["loop_late_s"] >= totals_after_hold["loop_late_s"] >= 0.39  # cumulative
    assert totals["loop_stalled_s"] >= held["stalled_s"]
