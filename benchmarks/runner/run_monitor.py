"""What the machine did while a benchmark run trained: CPU per role of the run's processes and, where
`nvidia-smi` exists, the GPU's utilization, sampled in the background into the run's directory.

    with RunMonitor(run_dir):   # cpu_by_role.jsonl, gpu_dmon.log (and gpu_pmon.log) in run_dir
        subprocess.run([... "tandem", "train", ...])

Roles come from each process's command line (the driver `tandemrl.cli train`, the engine
`serve-engine`, the retrieval server `serve-retrieval`, the Ray actor `ray::ActorWorker`, Ray's own
daemons); a row holds the epoch time and each role's CPU use in cores over the last interval, so a row
can be matched to a step by `wall_time` in the run's metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

ROLES = (  # (role, what its command line contains), first match wins
    ("engine", "serve-engine"),
    ("retrieval", "serve-retrieval"),
    ("actor", "ray::ActorWorker"),
    ("driver", "tandemrl.cli train"),
    ("sglang", "sglang"),
    ("vllm", "vllm"),
    ("ray", "ray::"),
    ("ray", "raylet"),
    ("ray", "gcs_server"),
)
TICKS_S = os.sysconf("SC_CLK_TCK")


def _role(cmdline: str) -> str | None:
    return next((role for role, needle in ROLES if needle in cmdline), None)


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for every process with a role."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            role = _role(cmdline)
            if role is None:
                continue
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        found[int(entry)] = (role, (int(fields[11]) + int(fields[12])) / TICKS_S)
    return found


class RunMonitor:
    def __init__(self, run_dir: Path, interval_s: float = 0.5):
        self.run_dir, self.interval_s = Path(run_dir), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="run-monitor", daemon=True)
        self._smi: list[subprocess.Popen] = []

    def __enter__(self) -> RunMonitor:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if shutil.which("nvidia-smi"):
            for kind in ("dmon", "pmon"):
                log = (self.run_dir / f"gpu_{kind}.log").open("w")
                command = ["nvidia-smi", kind, "-s", "u", "-o", "DT"]
                self._smi.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for process in self._smi:
            process.terminate()
            process.wait(timeout=5)

    def _sample(self) -> None:
        previous, previous_s = _cpu_by_pid(), time.monotonic()
        with (self.run_dir / "cpu_by_role.jsonl").open("w") as out:
            while not self._stop.wait(self.interval_s):
                current, now_s = _cpu_by_pid(), time.monotonic()
                cores: dict[str, float] = {}
                for pid, (role, cpu_s) in current.items():
                    before = previous.get(pid, (role, cpu_s))[1]
                    cores[role] = cores.get(role, 0.0) + (cpu_s - before) / (now_s - previous_s)
                row = {"wall_time": time.time(), "load1": os.getloadavg()[0], **cores}
                out.write(json.dumps(row) + "\n")
                out.flush()
                previous, previous_s = current, now_s
