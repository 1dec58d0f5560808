"""The run's reaper: a small process that outlives `tandem train` only to clean up after it.

Every process a run starts inherits `TANDEM_RUN_ID` (its servers, Ray's GCS, raylet, agents and
workers). The reaper holds the read end of a pipe whose write end only the run's main process owns;
when that process ends, however it ends (kill -9 included), the read sees end-of-file and the reaper
stops every process of this machine still carrying the run's id: SIGTERM, then SIGKILL after a grace
period. Servers also die with their parent by themselves (child_server.py); the reaper is what
catches Ray's own processes. Invariant: it never touches a process without the run's id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN_ID_ENV = "TANDEM_RUN_ID"
GRACE_S = 3.0


def start_reaper() -> subprocess.Popen:
    """Tag this process (and so all it starts from now on) with a fresh run id; start its reaper."""
    run_id = os.environ.setdefault(RUN_ID_ENV, uuid.uuid4().hex)
    return subprocess.Popen(
        [sys.executable, "-m", "tandemrl.cluster.reaper", run_id, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C in the terminal is the run's to handle, not the reaper's
        env={k: v for k, v in os.environ.items() if k != RUN_ID_ENV},
    )


def tagged_pids(run_id: str, exclude: tuple[int, ...] = ()) -> list[int]:
    """Processes of this user whose environment holds TANDEM_RUN_ID=<run_id> (this one aside)."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *exclude):
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return pids


def reap(run_id: str, grace_s: float = GRACE_S) -> list[int]:
    """Stop every process tagged with `run_id`; returns the pids that were still running."""
    found = tagged_pids(run_id)
    for pid in found:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and tagged_pids(run_id):
        time.sleep(0.1)
    for pid in tagged_pids(run_id):
        _signal(pid, signal.SIGKILL)
    return found


def _wait_exit(pid: int) -> None:
    """The pipe closes while the run's process finalizes: sweep only once it is gone (it may carry
    the run id itself, when it was started with one)."""
    while Path(f"/proc/{pid}").exists() and not _is_zombie(pid):
        time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(run_id: str, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns when the run's main process has ended
    _wait_exit(parent_pid)
    reaped = reap(run_id)
    if reaped:
        print(f"tandem reaper: stopped {len(reaped)} leftover process(es) of run {run_id}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
