"""A run holds its output directory: one `tandem train` per `runner.output_dir` at a time.

Two runs on one directory would replace each other's checkpoints, interleave `metrics.jsonl` and leave
the second one's `config.yaml`. The run takes an exclusive `flock` on `<output_dir>/.tandem.lock`
before it starts anything and keeps the descriptor open until it ends. The kernel drops the lock when
the process dies, kill -9 included, so a killed run's leftover file blocks nothing; the file stays (a
lock file removed while another process waits on it would let two runs in) and holds the holder's
pid, host and start time for the refusal line. The descriptor is close-on-exec: servers the run
spawns do not inherit (and so do not prolong) the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tandemrl.config.schema import ConfigError

LOCK_FILE = ".tandem.lock"
_held: dict[str, int] = {}  # resolved output dir -> this process's locked descriptor


def _refusal(output_dir: Path, fd: int) -> ConfigError:
    try:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that wrote nothing"
    except OSError:
        holder = "unknown"
    return ConfigError(
        f"runner.output_dir={str(output_dir)!r} is in use by another run ({holder}); two runs there would "
        "replace each other's checkpoints and interleave metrics.jsonl. Give this run another "
        "runner.output_dir, or wait for that run to end (a killed run holds nothing)."
    )


def _open_lock_file(output_dir: Path) -> int:
    return os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path) -> Iterator[Path]:
    """Hold `output_dir` (created if needed) for the duration; ConfigError at once if another process
    holds it. Re-entrant within one process."""
    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        key = str(output_dir.resolve())
        fd = None if key in _held else _open_lock_file(output_dir)
    except OSError as error:
        raise ConfigError(
            f"runner.output_dir={str(output_dir)!r} cannot hold the run ({error.strerror or error}: "
            f"{error.filename or output_dir}); give a directory this user can create and write."
        ) from None
    if fd is None:  # this process holds it already
        yield output_dir
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _refusal(output_dir, fd)
        os.close(fd)
        raise error from None
    try:
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
        _held[key] = fd
        yield output_dir
    finally:
        _held.pop(key, None)
        os.close(fd)  # releases the lock
