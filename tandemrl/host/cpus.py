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


# the compute thread pools a child reads at start-up (OpenMP, OpenBLAS, MKL)
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env(num_threads: int) -> dict[str, str]:
    """The environment that starts a child's compute pools at `num_threads` ({} for 0: their default)."""
    return {key: str(num_threads) for key in THREAD_ENV} if num_threads > 0 else {}


def limit_threads(num_threads: int) -> int | None:
    """Cap this process's BLAS and OpenMP pools (already loaded) and torch's intra-op pool at
    `num_threads`; returns the largest BLAS pool after, None where threadpoolctl is not installed."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(num_threads)
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return None
    threadpool_limits(num_threads)
    return max((pool["num_threads"] for pool in threadpool_info()), default=None)
