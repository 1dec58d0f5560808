"""The one resolver of `auto` devices and dtypes: the engine, the actor and the server supervisors all
ask here, so they agree on what `auto` means on this machine.

Invariant: `auto` is CUDA when torch sees a GPU, else CPU; the `auto` dtype is bfloat16 on CUDA and float32
on CPU. An explicit value passes through unchanged. torch is imported only to answer `auto`.
"""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" or "cpu" (what this process sees); anything else unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> "bfloat16" on a CUDA device ("cuda", "cuda:1"), "float32" elsewhere; anything else unchanged."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
