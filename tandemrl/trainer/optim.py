"""AdamW and its learning-rate schedule (linear warm-up, then constant or cosine to a floor).

Invariant: the schedule is a pure function of the number of parameter updates done, so a checkpoint
that restores the scheduler's step restores the exact learning rate.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from tandemrl.config.actor import OptimConfig


def lr_factor(update: int, optim: OptimConfig, total_updates: int) -> float:
    """Multiplier of `optim.lr` for the `update`-th parameter update (0-based)."""
    if optim.warmup_steps > 0 and update < optim.warmup_steps:
        return (update + 1) / optim.warmup_steps
    if optim.lr_schedule == "constant":
        return 1.0
    decay_updates = max(1, total_updates - optim.warmup_steps)
    progress = min(1.0, (update - optim.warmup_steps) / decay_updates)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine


def build_optimizer(
    params,
    optim: OptimConfig,
    total_updates: int,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = list(params)
    # plain CUDA tensors (a single GPU rank): one fused kernel; otherwise foreach, one kernel per op over
    # all tensors, far fewer (DTensor) dispatches than a per-tensor loop
    fused = all(p.is_cuda and not isinstance(p, DTensor) for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        weight_decay=optim.weight_decay,
        eps=1e-8,
        fused=fused or None,
        foreach=None if fused else True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: lr_factor(update, optim, total_updates)
    )
    return optimizer, scheduler
