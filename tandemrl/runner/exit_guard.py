"""A second Ctrl-C always ends the `tandem` process, whatever it waits on.

The first SIGINT (or SIGTERM) unwinds the command: its services stop and it prints one line. But Python
only exits once every non-daemon thread has ended, and `asyncio.run` waits for its executor's threads: a
thread stuck in a long computation (the actor's reference decode of `runner.weights_check_tokens`, run
through `asyncio.to_thread`) kept a stopped run alive for minutes, deaf to further Ctrl-Cs. So, in the
`tandem` process only (never in a library caller or a test's own process), a second signal, or the stop
line itself, arms a daemon thread that ends the process with `os._exit` once `GRACE_S` have passed without
it ending by itself. Leftovers are not a concern: every server the run started dies with it
(`PR_SET_PDEATHSIG`) and the run's reaper ends the rest (cluster/reaper.py).
"""

from __future__ import annotations

import os
import threading

GRACE_S = 5.0  # the normal unwinding (services stopped, logs closed) ends well within this
STILL_RUNNING = "stopped, but a thread was still running"  # the reason a command's stop line arms it for

_enabled = False
_armed = False
_disarmed: threading.Event | None = None  # set to cancel the armed guard
_reason: str | None = None  # what it was armed for
_lock = threading.Lock()


def enable() -> None:
    """Called by the `tandem` command itself (cli.main without argv): this process may be ended."""
    global _enabled
    _enabled = True


def is_enabled() -> bool:
    return _enabled


def arm(exit_code: int, reason: str, grace_s: float = GRACE_S, line: str | None = None) -> bool:
    """End this process with `exit_code` `grace_s` from now unless it has exited by then, or the guard was
    disarmed (once; only where enabled). `line`, when given, is printed first: the stop line the command
    would have printed had it got there. Returns whether a guard runs."""
    global _armed, _disarmed, _reason
    with _lock:
        if not _enabled or _armed:
            return _armed
        _armed, _reason = True, reason
        disarmed = _disarmed = threading.Event()

    def guard() -> None:
        if disarmed.wait(grace_s):
            return
        text = (
            f"{line}\n" if line else ""
        ) + f"tandem: {reason}; ending now, without waiting for what is still running.\n"
        os.write(2, text.encode())
        os._exit(exit_code)

    threading.Thread(target=guard, name="tandem-exit-guard", daemon=True).start()
    return True


def disarm(reason: str) -> None:
    """The wait the guard was armed for (`reason`) is over: the command got past it and ends by itself. A
    guard armed for something else (a second Ctrl-C) stays; a later signal may arm it again."""
    global _armed
    with _lock:
        if _armed and _reason == reason and _disarmed is not None:
            _disarmed.set()
            _armed = False
