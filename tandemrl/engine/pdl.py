"""Programmatic dependent launch (PDL, Hopper and later) for the engine's small Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still finishing, so its
launch latency and its prologue overlap that kernel's tail; inside a decode step's CUDA graph that is
one overlap per layer and kernel. Invariant: a PDL kernel calls `tl.extra.cuda.gdc_wait()` before it
touches memory the kernel before it may read or write: its inputs, and its outputs, whose memory the
allocator may have just recycled. Only step inputs written before that kernel started (context lengths,
block tables, RoPE tables) may be read before the wait. `TANDEM_ENGINE_PDL=0` turns it off (for A/B
timing: on the H200 it shortened a decode step's graph replay from 3.10 to 3.06 ms).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _supported(device_index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    if os.environ.get("TANDEM_ENGINE_PDL", "1") == "0":
        return False
    has_option = "launch_pdl" in CUDAOptions.__dataclass_fields__
    return has_option and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels on this tensor's device launch with PDL."""
    return tensor.is_cuda and _supported(tensor.device.index or 0)
