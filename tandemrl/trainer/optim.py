"""AdamW and its learning-rate schedule (linear warm-up, then constant or cosine to a floor).

fp32 parameters with fp32 moments (the default) step with torch.optim.AdamW; bf16 parameters
(`actor.param_dtype`) or bf16 moments (`actor.optim.state_dtype`) with trainer/low_precision.py's AdamW,
whose update is fp32 arithmetic written back by stochastic rounding.

Invariant: the schedule is a pure function of the number of parameter updates done, so a checkpoint
that restores the scheduler's step restores the exact learning rate.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from tandemrl.config.actor import OptimConfig
from tandemrl.trainer.low_precision import LowPrecisionAdamW

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    state_dtype = DTYPES[optim.state_dtype]
    if state_dtype != torch.float32 or any(p.dtype != torch.float32 for p in params):
        optimizer: torch.optim.Optimizer = LowPrecisionAdamW(
            params,
            lr=optim.lr,
            betas=tuple(optim.betas),
            weight_decay=optim.weight_decay,
            eps=1e-8,
            state_dtype=state_dtype,
        )
    else:
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
