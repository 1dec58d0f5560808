"""`auto` devices and dtypes made concrete, one rule for every component: `auto` is CUDA where torch sees a
GPU, else CPU; an `auto` dtype is bfloat16 on CUDA and float32 on CPU. The engine (engine/engine.py), the
actor (trainer/policy.py) and the run's launch (runner/services.py, cluster/server_supervisor.py) all
resolve through here, so one config means the same device everywhere. torch is imported only to look.
"""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """`auto` -> "cuda" or "cpu"; any other name as given (e.g. "cuda:1")."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` -> "bfloat16" on a CUDA device, "float32" elsewhere; any other name as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
