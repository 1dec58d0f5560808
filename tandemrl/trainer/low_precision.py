"""bf16 parameters (`actor.param_dtype=bfloat16`) and bf16 AdamW moments (`actor.optim.state_dtype`): the
stochastic rounding that writes an fp32 result into a bf16 tensor, and the AdamW that uses it.

Why stochastic rounding: bf16 keeps 8 significant bits, so a weight w can only move in steps of |w|/256 to
|w|/128. An AdamW update is about lr (1e-6 in RL) a step, tens to hundreds of times under half that step,
so round-to-nearest writes w back unchanged at every update and the model never trains. Rounding up with
probability (x - lower) / (upper - lower) makes the stored value equal x in expectation: each tiny update
moves a weight by one ulp now and then, as often as its size says, and the updates add up. The moments
need it too when they are bf16: exp_avg_sq changes by (1 - beta2) = 0.1% of itself per step, under half
an ulp, and would freeze at round-to-nearest.

Invariant: the arithmetic of every update is fp32 (parameter, gradient and moments read into fp32); only
the writes back to bf16 storage round, and those round stochastically. A parameter or moment kept in fp32
is updated in place, exactly as torch.optim.AdamW's formula does.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# elements of a tensor updated at once: the update's fp32 temporaries (gradient, parameter, moments, the
# denominator, the random bits) stay a few times 64 MB whatever the size of the largest tensor
STEP_CHUNK_NUMEL = 2**24
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def stochastic_round_(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Write fp32 `source` into bf16 `target` (same shape), rounding each value to one of its two bf16
    neighbours, up with probability equal to its distance from the lower one over their gap: unbiased, and
    never more than one bf16 ulp from `source`. `source` is overwritten (its low 16 bits cleared).

    A bf16 is the upper 16 bits of an fp32: adding 16 uniform random bits to the lower half carries into
    the upper half with exactly that probability, and clearing the lower half truncates. Sign-magnitude
    bits make it hold for negative values too; an infinity stays one (its lower half is zero)."""
    assert source.dtype == torch.float32 and target.dtype == torch.bfloat16, (source.dtype, target.dtype)
    bits = source.view(torch.int32)
    noise = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, device=source.device)
    bits.add_(noise).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as an int32
    return target.copy_(source)  # exact: every value now has a bf16 representation


def stochastic_round(source: torch.Tensor) -> torch.Tensor:
    """A bf16 copy of `source` by `stochastic_round_` (`source` is left as it was)."""
    return stochastic_round_(
        torch.empty_like(source, dtype=torch.bfloat16), source.to(torch.float32, copy=True)
    )


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter of `module` to `dtype`, in place (ties kept: the Parameter objects stay).
    Buffers are left as they are: `module.to(dtype)` would round the rotary embedding's fp32 inverse
    frequencies, which HF itself keeps fp32 when it loads a model in bf16."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    return module


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (its storage: in-place updates reach the DTensor), or `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's formula, decoupled weight decay, bias-corrected moments) over fp32 or bf16
    parameters with fp32 or bf16 moments; see the module docstring. A DTensor parameter is updated through
    its local shard, and its moments are DTensors sharded like it, so DCP saves and reshards them."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float32,
    ):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype={state_dtype}: the moments are float32 or bfloat16")
        self.state_dtype = state_dtype
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:  # zeros_like of a DTensor is a DTensor of the same sharding
            state["step"] = torch.tensor(0.0)
            for key in STATE_KEYS:
                state[key] = torch.zeros_like(
                    param, dtype=self.state_dtype, memory_format=torch.preserve_format
                )
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        coefs = dict(
            decay=1.0 - lr * group["weight_decay"],
            beta1=beta1,
            beta2=beta2,
            step_size=lr / (1.0 - beta1**step),
            bias2_sqrt=math.sqrt(1.0 - beta2**step),
            eps=group["eps"],
        )
        flat = [_local(t).view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
        for start in range(0, flat[0].numel(), STEP_CHUNK_NUMEL):
            _update_chunk(*(t[start : start + STEP_CHUNK_NUMEL] for t in flat), **coefs)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the moments put back from `state_dict` in `state_dict`'s dtype: torch casts
        every floating state tensor to its parameter's dtype (`Optimizer._process_value_according_to_param_
        policy`), which would round fp32 moments of bf16 parameters to bf16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key in STATE_KEYS:
                if key in saved:
                    self.state[param][key] = saved[key].to(device=param.device, dtype=self.state_dtype)


def _update_chunk(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    step_size: float,
    bias2_sqrt: float,
    eps: float,
) -> None:
    """One AdamW update of contiguous 1-D slices in fp32 (`.float()` of an fp32 tensor is the tensor itself,
    so an fp32 slice is updated in place); each bf16 slice is written back by stochastic rounding, once its
    fp32 value has served the parameter's update."""
    grad32 = grad.float()
    exp_avg32 = exp_avg.float().lerp_(grad32, 1.0 - beta1)
    exp_avg_sq32 = exp_avg_sq.float().mul_(beta2).addcmul_(grad32, grad32, value=1.0 - beta2)
    denom = exp_avg_sq32.sqrt().div_(bias2_sqrt).add_(eps)
    param32 = param.float().mul_(decay).addcdiv_(exp_avg32, denom, value=-step_size)
    for target, value in ((param, param32), (exp_avg, exp_avg32), (exp_avg_sq, exp_avg_sq32)):
        if target.dtype == torch.bfloat16:
            stochastic_round_(target, value)
