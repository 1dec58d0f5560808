"""PPO clipped policy loss with GRPO advantages, per token, plus the statistics the actor logs.

Invariant: everything here returns per-token *sums* over masked tokens, never means. The actor
divides by the number of model tokens of the whole minibatch (over all micro-batches and ranks), so
gradient accumulation gives exactly the token-mean over the minibatch, whatever the ragged lengths
and however the samples were packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_VAR_KL_CLAMP = 10.0  # as verl: keeps one outlier token from dominating the KL penalty


@dataclass
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0

    @classmethod
    def from_algorithm(cls, algorithm) -> PolicyLossConfig:
        high = algorithm.ratio_clip_eps_high
        return cls(
            clip_eps_low=algorithm.ratio_clip_eps,
            clip_eps_high=algorithm.ratio_clip_eps if high is None else high,
            dual_clip_c=algorithm.dual_clip_c,
            kl_coef=algorithm.kl_coef,
        )


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio - 1).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def ppo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cfg: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss (to be minimised) and per-token statistics, unmasked.

    loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with the dual clip, for A < 0 the loss is
    further capped at -A c (= c |A|), so a huge ratio on a bad token cannot blow up the update.
    """
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if cfg.dual_clip_c is not None:
        cap = -advantages * cfg.dual_clip_c
        is_dual = (advantages < 0) & (loss > cap)
        loss = torch.where(is_dual, cap, loss)
        is_clipped = is_clipped | is_dual
    stats = {
        "ratio_abs": (ratio - 1).abs().detach(),
        "clip_fraction": is_clipped.float().detach(),
        # k3 estimate of KL(pi_old || pi): r - 1 - log r, unbiased and >= 0 under samples from pi_old
        "approx_kl": (ratio - 1 - log_ratio).detach(),
    }
    if ref_logprobs is not None and cfg.kl_coef > 0:
        kl = low_var_kl(logprobs, ref_logprobs)
        loss = loss + cfg.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    return loss, stats


def masked_sum_tensors(values: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sum of each per-token tensor over the masked tokens, as 0-d tensors on their device (no host sync)."""
    return {name: (value.detach().double() * mask).sum() for name, value in values.items()}


def masked_sums(values: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """`masked_sum_tensors` as Python floats."""
    return {name: float(value) for name, value in masked_sum_tensors(values, mask).items()}
