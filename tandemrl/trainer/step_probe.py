"""What one train step spent its time on, so that a slow step on a shared GPU can be attributed
(docs/DESIGN.md, Sharing a GPU): the seconds the host sat blocked on the GPU (the step's few sync
points: grad norms and the metric reduce) against the seconds it spent launching work, the process's
CPU seconds and involuntary context switches over the step (CPU contention shows as host seconds far
above CPU seconds, with many switches), garbage-collection pauses, and the caching allocator's retries
and device allocations (a retry frees the cache and synchronizes the device).

Invariant: cheap enough to run on every step (a few syscalls and counter reads); nothing here syncs
the GPU beyond the step's own sync points.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_gc_seconds = 0.0  # process-wide time spent in collections, advanced by the callback below
_gc_started: float | None = None


def _on_gc(phase: str, info: dict) -> None:
    global _gc_seconds, _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    elif _gc_started is not None:
        _gc_seconds += time.perf_counter() - _gc_started
        _gc_started = None


if _on_gc not in gc.callbacks:
    gc.callbacks.append(_on_gc)

ALLOCATOR_KEYS = {"num_alloc_retries": "alloc_retries", "num_device_alloc": "device_allocs"}


def _allocator_counts(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: float(stats.get(key, 0)) for key, name in ALLOCATOR_KEYS.items()}


class StepProbe:
    """Open with `start()`, wrap each host sync in `waiting()`, read `metrics()` at the end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.wait_s = 0.0

    def start(self) -> StepProbe:
        self._wall = time.perf_counter()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._gc = _gc_seconds
        self._allocator = _allocator_counts(self.device)
        return self

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time a host sync (a `.item()`, `float(tensor)` or `.cpu()` of a device tensor)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        wall_s = time.perf_counter() - self._wall
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (usage.ru_utime - self._usage.ru_utime) + (usage.ru_stime - self._usage.ru_stime)
        metrics = {
            "perf/actor/wait_gpu_s": self.wait_s,
            "perf/actor/host_s": wall_s - self.wait_s,
            "perf/actor/cpu_s": cpu_s,
            "perf/actor/involuntary_switches": float(usage.ru_nivcsw - self._usage.ru_nivcsw),
            "perf/actor/gc_s": _gc_seconds - self._gc,
        }
        after = _allocator_counts(self.device)
        for name, value in after.items():
            metrics[f"perf/actor/{name}"] = value - self._allocator[name]
        return metrics
