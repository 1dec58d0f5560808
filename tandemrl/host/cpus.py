"""Which cores a process may run on: Linux CPU affinity (`sched_setaffinity`), for the run's CPU plan
(cluster/cpus.py). A child started with `pin_child` (as `preexec_fn`) and a process that calls
`pin_process` keep to the cores given, and so does every thread and child they start afterwards."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable


def can_pin() -> bool:
    return sys.platform == "linux" and hasattr(os, "sched_setaffinity")


def available_cpus() -> list[int]:
    """The cores this process may use now (a cgroup's cpuset or a `taskset` already narrowed them)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process onto `cpus` (the threads it starts later inherit their creator's)."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def pin_child(cpus: Iterable[int]) -> None:
    """In a child between fork and exec (one thread): the program it runs starts on `cpus`."""
    os.sched_setaffinity(0, set(cpus))


def id_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the `taskset -c` form; GPU ids print the same way)."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = None
    for index, cpu in enumerate(ordered):
        start = cpu if start is None else start
        if index + 1 == len(ordered) or ordered[index + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)
