"""CPU seconds of a whole command's process tree, and the wall time it would take on an idle N-core box.

    python -m benchmarks.runner.demo_cpu                                  # `tandem demo` (prepare, cold start, RL)
    python -m benchmarks.runner.demo_cpu --label sft -- tandem sft CONFIG actor.sft.num_demos=64

On a machine shared with other jobs, wall time overstates what a user sees on an idle one. The CPU
seconds that the command's processes consume do not: the tree (the driver, the engine and retrieval
servers, Ray's raylet and workers) is sampled with psutil every `--interval` seconds and each process
counts with the last CPU time seen for it (user + system; a process that lives shorter than one
interval is missed, so the figure is a slight underestimate). The estimate of an uncontended wall time
is cpu_s / cores: the demo keeps both cores busy (torch intra-op threads in the actor and the engine),
so it is a lower bound that holds when the work parallelises, and the JSON keeps both figures.
Writes benchmarks/results/runner/demo_cpu_<label>.json with a (wall_s, cpu_s) timeline every 10 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks import write_json

RESULTS = Path(__file__).resolve().parents[1] / "results" / "runner"


def tree_cpu(root: psutil.Process, seen: dict[int, float]) -> float:
    """Update `seen` (pid -> CPU seconds) from the live tree under `root`; returns the sum so far."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            times = proc.cpu_times()
            seen[proc.pid] = max(seen.get(proc.pid, 0.0), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sum(seen.values())


def measure(cmd: list[str], interval: float) -> dict:
    start = time.monotonic()
    child = subprocess.Popen(cmd)
    root = psutil.Process(child.pid)
    seen: dict[int, float] = {}
    timeline, last_mark = [], 0.0
    while child.poll() is None:
        cpu = tree_cpu(root, seen)
        wall = time.monotonic() - start
        if wall - last_mark >= 10.0:
            timeline.append([round(wall, 1), round(cpu, 1)])
            last_mark = wall
        time.sleep(interval)
    wall = time.monotonic() - start
    cpu = sum(seen.values())
    return {
        "returncode": child.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "timeline": timeline,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", default="demo")
    parser.add_argument("--cores", type=int, default=2, help="cores of the box the estimate is for")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("cmd", nargs="*", help="the command (after --); default: tandem demo")
    args = parser.parse_args()
    cmd = args.cmd or [shutil.which("tandem") or "tandem", "demo"]
    result = measure(cmd, args.interval)
    result.update(
        label=args.label,
        cmd=cmd,
        cores=args.cores,
        est_uncontended_wall_s=round(result["cpu_s"] / args.cores, 1),
        machine_cores=os.cpu_count(),
        loadavg_1m_at_end=round(os.getloadavg()[0], 2),
        platform=platform.platform(),
        tandem_home=os.environ.get("TANDEM_HOME", "~/.cache/tandemrl"),
    )
    out = write_json(RESULTS / f"demo_cpu_{args.label}.json", result, indent=1)
    print(
        f"{args.label}: rc {result['returncode']}, wall {result['wall_s']} s (this machine, load "
        f"{result['loadavg_1m_at_end']}), CPU {result['cpu_s']} s -> ~{result['est_uncontended_wall_s']} s "
        f"on an idle {args.cores}-core box; {out}"
    )
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
