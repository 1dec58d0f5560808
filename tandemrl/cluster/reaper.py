"""The run's reaper: a small process that outlives `tandem train` only to clean up after it.

Every process a run starts inherits `TANDEM_RUN_ID` (its servers, Ray's GCS, raylet and workers). The
reaper holds the read end of a pipe whose write end only the run's main process owns; when that
process ends, however it ends (kill -9 included), the read sees end-of-file and the reaper stops every
process of this machine that belongs to the run: SIGTERM, then SIGKILL after a grace period. Servers
also die with their parent by themselves (child_server.py); the reaper is what catches Ray's own
processes. Ray's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) do not reliably show the id
(their process title rewrites the memory /proc shows as their environment), so the run tells the
reaper, through the same pipe, the session directory of the local Ray it started
(`note_ray_session`): a process titled `ray::...` that holds a file open inside that directory (its
logs), or one that passes it as a `--flag=` value (GCS, raylet, Ray's monitors), belongs to the run
too, and so do the session directories named on the command lines of the run's tagged processes.
Once the run's processes are gone it removes the API key files its SGLang servers were given
(rollout/sglang_process.py), and those of any run of this user with no process left. Invariant: it
touches only this user's processes that carry the run's id or belong, so, to a Ray session this run
started, and only this user's key directories whose owner has no process left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tandemrl.host.child_server import RUN_ID_ENV, RUN_PID_ENV

GRACE_S = 3.0
RAY_SESSION = "ray-session"  # the pipe's one message: "ray-session <dir>\n"
_SESSION_FLAGS = ("--session-dir=", "--session_dir=", "--log_dir=", "--logs-dir=", "--log-dir=")

_reaper: subprocess.Popen | None = None  # this process's reaper, when it started one


def start_reaper() -> subprocess.Popen:
    """Tag this process (and so all it starts from now on) with a run id; start its reaper. The id is
    fresh unless the environment names one for this very process: one given by whoever started it
    (`TANDEM_RUN_ID` alone, as the fault tests name their runs) is kept, but one inherited from another
    run's process tree (`TANDEM_RUN_PID` names another process) is replaced. A `tandem train` started by a
    driver that ran one in-process before, or by a script a run launched, is a run of its own, and its
    reaper must not stop the other run's processes: with the inherited id, a nested run's reaper stopped
    the shell script that had started it."""
    global _reaper
    given, main_pid = os.environ.get(RUN_ID_ENV), os.environ.get(RUN_PID_ENV)
    inherited = main_pid is not None and main_pid != str(os.getpid())
    run_id = os.environ[RUN_ID_ENV] = uuid.uuid4().hex if given is None or inherited else given
    os.environ[RUN_PID_ENV] = str(os.getpid())
    _reaper = subprocess.Popen(
        [sys.executable, "-m", "tandemrl.cluster.reaper", run_id, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C in the terminal is the run's to handle, not the reaper's
        env={k: v for k, v in os.environ.items() if k not in (RUN_ID_ENV, RUN_PID_ENV)},
    )
    return _reaper


def note_ray_session(session_dir: str | None) -> None:
    """Tell this process's reaper the session directory of a local Ray it started (no reaper: no-op)."""
    reaper = _reaper
    if reaper is None or reaper.stdin is None or not session_dir or reaper.poll() is not None:
        return
    try:
        reaper.stdin.write(f"{RAY_SESSION} {session_dir}\n".encode())
        reaper.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def ray_session_pids(session_dirs: set[str], exclude: tuple[int, ...] = ()) -> list[int]:
    """This user's processes of the Ray sessions in `session_dirs`: `ray::` processes (agents, workers)
    holding a file open inside one, and Ray's daemons, which pass one as a `--flag=` value (a `tail` of
    a log names it as a bare argument and is left alone)."""
    roots = [d.rstrip("/") for d in session_dirs if d.startswith("/")]
    prefixes = tuple(root + "/" for root in roots)
    pids = []
    for entry in Path("/proc").iterdir() if roots else ():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *exclude):
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(_is_flag_of(arg, roots) for arg in args[1:]) or (
                args[0].startswith("ray::")
                and any(os.readlink(fd).startswith(prefixes) for fd in (entry / "fd").iterdir())
            ):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def _is_flag_of(arg: str, roots: list[str]) -> bool:
    if not arg.startswith("--") or "=" not in arg:
        return False
    value = arg.split("=", 1)[1]
    return any(value == root or value.startswith(root + "/") for root in roots)


def sessions_of(pids: list[int]) -> set[str]:
    """The Ray session directories named on the command lines of `pids` (the run's GCS, raylet...)."""
    found = set()
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            for flag in _SESSION_FLAGS:
                if arg.startswith(flag):
                    path = Path(arg[len(flag) :])
                    path = path.parent if path.name == "logs" else path
                    if path.name.startswith("session_") and path.is_absolute():
                        found.add(str(path))
    return found


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


def reap(run_id: str, session_dirs: set[str] = frozenset(), grace_s: float = GRACE_S) -> list[int]:
    """Stop every process of the run (see the module doc); returns the pids that were still running."""
    tagged = tagged_pids(run_id)
    sessions = set(session_dirs) | sessions_of(tagged)

    def members() -> list[int]:
        return sorted(set(tagged_pids(run_id)) | set(ray_session_pids(sessions)))

    found = sorted(set(tagged) | set(ray_session_pids(sessions)))
    for pid in found:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and members():
        time.sleep(0.1)
    for pid in members():
        _signal(pid, signal.SIGKILL)
    return found


def remove_key_dirs(run_id: str | None = None) -> list[Path]:
    """Remove the SGLang key directories (rollout/sglang_process.py) of `run_id`, or, without one, of
    every owner that has no process left (a run with no tagged process, a `pid<N>` that is gone). Only
    this user's directories in this machine's temp directory; returns those removed."""
    import shutil
    import tempfile

    from tandemrl.rollout.sglang_process import KEY_DIR_PREFIX

    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{KEY_DIR_PREFIX}*-*"):
        owner = path.name[len(KEY_DIR_PREFIX) :].rsplit("-", 1)[0]
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if run_id is not None:
            is_dead = owner == run_id
        elif owner.startswith("pid") and owner[3:].isdigit():
            is_dead = not Path(f"/proc/{owner[3:]}").exists()
        else:
            is_dead = owner.isalnum() and not tagged_pids(owner)
        if is_dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
    remove_key_dirs()  # left by runs whose reaper was killed too
    sessions = set()
    for line in sys.stdin.buffer:  # ends when the run's main process has ended
        kind, _, value = line.decode(errors="replace").strip().partition(" ")
        if kind == RAY_SESSION and value.startswith("/"):
            sessions.add(value)
    _wait_exit(parent_pid)
    reaped = reap(run_id, sessions)
    remove_key_dirs(run_id)  # its servers are gone: their key files go too
    remove_key_dirs()  # and those left by runs that ended without their reaper
    if reaped:
        print(f"tandem reaper: stopped {len(reaped)} leftover process(es) of run {run_id}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
