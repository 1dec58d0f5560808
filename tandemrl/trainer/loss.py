"""PPO clipped policy loss with GRPO advantages, per token, plus the statistics the actor logs.

Invariant: everything here returns per-token *sums* over masked tokens, never means. The actor
divides by the number of model tokens of the whole minibatch (over all micro-batches and ranks), so
gradient accumulation gives exactly the token-mean over the minibatch, whatever the ragged lengths
and however the samples were packed.

Off-policy correction (`algorithm.off_policy_correction`), for data sampled by an older or numerically
different rollout policy pi_behav. Both corrections need pi_prox: the actor's own logprobs at the
weights before this step's first update (`Actor` recomputes them), which then stand as the PPO ratio's
denominator; w = pi_prox / pi_behav (no gradient) multiplies each token's clipped PPO loss:
  decoupled (AReaL's decoupled PPO): w as is, but a token whose w exceeds `decoupled_weight_cap` gets
    weight 0 (it stays in the token count, so it dilutes rather than vanishes);
  tis (truncated importance sampling, as verl and slime): min(w, tis_cap).
The clipping keeps pi_theta near pi_prox, not near the stale pi_behav; w corrects the sampling.
With `algorithm.proximal_logprobs=current` pi_prox is each minibatch's own forward, detached (no extra
pass): the ratio is 1 where it is taken, nothing is clipped, and the gradient is the capped w times the
plain policy gradient. Each sample trains once a step (one pass over the minibatches), so the trust region
it gives up is what the step's earlier minibatches moved the weights.
With `algorithm.proximal_logprobs=loglinear` (AReaL's and slime's approximation) nothing is recomputed
either: the first minibatch's own forward is taken at the step's starting weights, so its detached
logprobs are pi_prox exactly; a later minibatch's are `loglinear_proximal`, between the rollout's and its
own forward's.
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
    off_policy_correction: str = "none"  # none | decoupled | tis
    is_weight_cap: float = 2.0  # the cap of the chosen correction

    @classmethod
    def from_algorithm(cls, algorithm) -> PolicyLossConfig:
        if algorithm.off_policy_correction is None:
            raise ValueError(
                "algorithm.off_policy_correction is unset: it is derived from runner.async_mode when the config "
                "is loaded (config/derive.py); set it (none, decoupled or tis) on a config built by hand"
            )
        high = algorithm.ratio_clip_eps_high
        return cls(
            clip_eps_low=algorithm.ratio_clip_eps,
            clip_eps_high=algorithm.ratio_clip_eps if high is None else high,
            dual_clip_c=algorithm.dual_clip_c,
            kl_coef=algorithm.kl_coef,
            off_policy_correction=algorithm.off_policy_correction,
            is_weight_cap=(
                algorithm.decoupled_weight_cap
                if algorithm.off_policy_correction == "decoupled"
                else algorithm.tis_cap
            ),
        )


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio - 1).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def importance_weights(
    prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, correction: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight applied to the PPO loss, and where the cap acted (bool); see the module docstring.

    w = exp(prox - behav), detached. An overflow to inf is capped like any other large weight.
    """
    weight = (prox_logprobs - behav_logprobs).detach().exp()
    is_capped = weight > cap
    if correction == "tis":
        return weight.clamp(max=cap), is_capped
    if correction == "decoupled":
        return torch.where(is_capped, torch.zeros_like(weight), weight), is_capped
    raise ValueError(f"unknown off-policy correction {correction!r}: expected decoupled or tis")


def loglinear_proximal(
    behav_logprobs: torch.Tensor, current_logprobs: torch.Tensor, lags: torch.Tensor
) -> torch.Tensor:
    """pi_prox without a forward pass at the step's starting weights, per token (no gradient): in log space,
    alpha of the way from the rollout's logprob to the current forward's, alpha = lag / (lag + 1), where
    `lag` is how many weight versions before the step's the token was sampled. The step's starting
    weights are `lag` updates past the token's sampler and the current weights about one past them, so
    a fresh token (lag 0) keeps its rollout logprob and a stale one leans towards the current forward."""
    alpha = lags / (lags + 1.0)
    behav = behav_logprobs.detach()
    return behav + alpha * (current_logprobs.detach() - behav)


def ppo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cfg: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    behav_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss (to be minimised) and per-token statistics, unmasked.

    loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with the dual clip, for A < 0 the loss is
    further capped at -A c (= c |A|), so a huge ratio on a bad token cannot blow up the update.
    With an off-policy correction, `old_logprobs` are the proximal ones and `behav_logprobs` (required)
    the rollout's: the loss is multiplied by `importance_weights`; the KL penalty is not.
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
        # the positive advantage, and the part of it the clip cut (ratio already above 1 + eps_high): with
        # stale data these are the tokens the policy has learned to favour since it sampled them
        "pos_advantage": advantages.clamp(min=0).detach(),
        "clipped_pos_advantage": (advantages.clamp(min=0) * is_clipped).detach(),
    }
    if cfg.off_policy_correction != "none":
        if behav_logprobs is None:
            raise ValueError(
                f"off_policy_correction={cfg.off_policy_correction!r} needs the rollout's behav_logprobs"
            )
        weight, is_capped = importance_weights(
            old_logprobs, behav_logprobs, cfg.off_policy_correction, cfg.is_weight_cap
        )
        loss = loss * weight
        stats.update(is_weight=weight, is_clip_fraction=is_capped.float())
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
