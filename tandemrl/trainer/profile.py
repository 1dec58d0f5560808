"""One train step under torch.profiler (`runner.profile_steps`): what a slow step on a shared GPU spent
its time on, kernel by kernel.

Writes, for a `path` stem: `<stem>.json.gz` (a Chrome trace: open it in Perfetto or chrome://tracing),
`<stem>_top.txt` (the operators with the most device time, then the most host time) and
`<stem>_summary.json` (the step's wall seconds, and the device seconds of its kernels and copies: a
step whose wall time far exceeds its kernels' waited for the GPU or for the CPU, not on its own work).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class _Profile(torch.profiler.profile):
    def _get_distributed_info(self):
        """torch stamps the trace with the process groups' configs, and raises on a group outside its
        registry (the gloo weight-update group of rollout/weight_sync.py): the trace goes without them."""
        try:
            return super()._get_distributed_info()
        except Exception:  # noqa: BLE001 - metadata only
            return None


@contextmanager
def profiled(path: str | Path, device: str | torch.device) -> Iterator[None]:
    from torch.profiler import ProfilerActivity

    stem = Path(path)
    stem.parent.mkdir(parents=True, exist_ok=True)
    is_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    prof = _Profile(activities=activities, record_shapes=False)
    try:
        prof.start()
    except Exception as error:  # a profile is a diagnosis: failing to take one must not end the run
        log.warning("torch.profiler did not start (%r): %s is not profiled", error, stem)
        yield
        return
    start_s = time.perf_counter()
    try:
        yield
        if is_cuda:
            torch.cuda.synchronize()
    finally:
        prof.stop()
    wall_s = time.perf_counter() - start_s
    try:
        _export(prof, stem, wall_s, is_cuda)
    except Exception as error:  # a profile is a diagnosis: failing to write it must not end the run
        log.warning("writing the profile %s failed: %r", stem, error)


def _export(prof, stem: Path, wall_s: float, is_cuda: bool) -> None:
    prof.export_chrome_trace(str(stem.with_name(stem.name + ".json.gz")))
    averages = prof.key_averages()
    device_key = "self_device_time_total" if is_cuda else "self_cpu_time_total"
    tables = [averages.table(sort_by=device_key, row_limit=25)]
    if is_cuda:
        tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    stem.with_name(stem.name + "_top.txt").write_text("\n\n".join(tables) + "\n")
    device_s = sum(getattr(event, "self_device_time_total", 0.0) for event in averages) / 1e6
    summary = {"wall_s": wall_s, "device_s": device_s if is_cuda else None}
    stem.with_name(stem.name + "_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
