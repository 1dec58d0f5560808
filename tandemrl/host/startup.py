"""The start-up timeline of a run: every process that takes part stamps its start-up phases, and `tandem
train` prints them once step 1 ends, in seconds since its own process started, and writes them to
`<runner.output_dir>/startup.json` (docs/DESIGN.md, Start-up).

A process marks a phase by appending one JSON line (wall-clock epoch seconds, its process name, the
phase) to the file named by $TANDEM_STARTUP_LOG. `tandem train` sets the variable before anything
starts, so its child processes inherit it; Ray actors are handed the path and `adopt` it, which passes
it on to the servers they launch. A process learns its name from $TANDEM_STARTUP_NAME (set by whoever
starts it), else it is named by its pid.

Invariant: marking never raises and costs one small append (one `write` on an O_APPEND file, so lines
of concurrent processes never interleave); a process that cannot write (no variable, a node without
the run's filesystem) has no phases in the timeline, and a line that cannot be parsed is skipped.
Times of processes on other nodes are as good as the nodes' clock agreement.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_LOG_ENV = "TANDEM_STARTUP_LOG"
STARTUP_NAME_ENV = "TANDEM_STARTUP_NAME"
STARTUP_FILE = "startup.json"

_marked_once: set[tuple[str, str]] = set()


def log_path() -> str | None:
    """The timeline file of the run this process belongs to, if any (to hand to Ray actors)."""
    return os.environ.get(STARTUP_LOG_ENV) or None


def adopt(path: str | None, name: str | None = None) -> None:
    """Join the run's timeline as `name` (a Ray actor, given the driver's `log_path()`); its children
    inherit both."""
    if path:
        os.environ[STARTUP_LOG_ENV] = path
    if name:
        os.environ[STARTUP_NAME_ENV] = name


def begin(path: str | Path, name: str) -> None:
    """Start a run's timeline in `path` (emptied), this process being `name`; a phase marked `once` in
    an earlier run of this process counts again."""
    Path(path).unlink(missing_ok=True)
    _marked_once.clear()
    adopt(str(path), name)


def process_name() -> str:
    return os.environ.get(STARTUP_NAME_ENV) or f"pid {os.getpid()}"


def mark(phase: str, process: str | None = None, at: float | None = None, once: bool = False) -> None:
    """Stamp `phase` of this process now (or at the epoch `at`); `once`: only its first call counts."""
    path = os.environ.get(STARTUP_LOG_ENV)
    if not path:
        return
    process = process or process_name()
    if once:
        if (process, phase) in _marked_once:
            return
        _marked_once.add((process, phase))
    line = json.dumps({"t": time.time() if at is None else at, "process": process, "phase": phase}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a timeline is a diagnostic: a process that cannot write just has no phases


def mark_process_started(process: str | None = None) -> None:
    """Stamp when this process was created (the interpreter start, before any import)."""
    started = process_start_epoch()
    if started is not None:
        mark("process started", process, at=started)


def process_start_epoch() -> float | None:
    """Wall-clock epoch at which this process was created (to a clock tick), or None where the system
    does not say. Linux counts a process's start in ticks since boot; psutil adds the boot time in
    whole seconds, which can be a second off, so the age is taken against the boot clock instead."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age_s
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except ImportError:
        return None


def read_marks(path: str | Path) -> list[dict]:
    """The marks of the file (unparseable lines skipped); [] when there is no file."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    marks = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
            marks.append({"t": float(row["t"]), "process": str(row["process"]), "phase": str(row["phase"])})
        except (ValueError, KeyError, TypeError):
            continue
    return marks


def timeline(marks: list[dict], origin_epoch: float) -> list[dict]:
    """The marks as `{"s": seconds since origin_epoch, "process", "phase"}`, in time order."""
    rows = [
        {"s": round(m["t"] - origin_epoch, 3), "process": m["process"], "phase": m["phase"]} for m in marks
    ]
    return sorted(rows, key=lambda row: row["s"])


def format_timeline(rows: list[dict]) -> list[str]:
    width = max((len(row["process"]) for row in rows), default=0)
    return [f"{row['s']:8.2f} s  {row['process']:<{width}}  {row['phase']}" for row in rows]


def write_report(output_dir: str | Path, rows: list[dict], origin: str, extra: dict | None = None) -> Path:
    """`<output_dir>/startup.json`: the timeline and where its clock starts."""
    path = Path(output_dir) / STARTUP_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"origin": origin, **(extra or {}), "phases": rows}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def report(
    log_file: str | Path, output_dir: str | Path, origin_epoch: float, origin: str, extra: dict
) -> None:
    """Print the timeline (one line per phase, in time order) and write startup.json; never raises."""
    try:
        rows = timeline(read_marks(log_file), origin_epoch)
        path = write_report(output_dir, rows, origin, extra)
    except OSError as error:
        log.warning("start-up timeline not written: %r", error)
        return
    log.info(
        "start-up timeline (seconds since %s), also in %s:\n%s",
        origin,
        path,
        "\n".join(format_timeline(rows)),
    )
