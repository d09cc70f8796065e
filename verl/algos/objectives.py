"""The per-micro-batch objectives every training engine minimises, and the rollout/train mismatch statistics.

    loss, stats = actor_loss(log_probs, entropy, mask, advantages, old_log_probs=..., ref_log_probs=...,
                             policy_loss="vanilla", clip_low=0.2, clip_high=0.28, agg=agg)
    loss, stats = critic_loss(values, mask, old_values, returns, cliprange=0.5, agg=agg)

All tensors are [B, R] over response tokens (R response columns, `mask` 1 on tokens up to and including EOS).
`agg` carries the step's global token / sequence counts and the data-parallel size, so the losses of all
micro-batches on all ranks add up to exactly the loss of the whole mini-batch (verl.ops.Aggregation). The
returned statistics are detached 0-d tensors; `ADDITIVE` names those that are parts of that sum (add them over
micro-batches), the others are token means of one micro-batch (average them).
"""

from __future__ import annotations

import torch

from verl.algos.kl import kl_loss
from verl.algos.policy_losses import get_policy_loss
from verl.ops.losses import Aggregation, agg_loss, value_loss

__all__ = ["ADDITIVE", "MISMATCH_THRESHOLD", "actor_loss", "critic_loss", "rollout_mismatch"]

ADDITIVE = frozenset({"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})
MISMATCH_THRESHOLD = 1e-3


def actor_loss(log_probs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
               old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None, policy_loss: str,
               clip_low: float, clip_high: float, clip_c: float, agg: Aggregation, entropy_coeff: float = 0.0,
               kl_coef: float = 0.0, kl_type: str = "low_var_kl", loss_params=None,
               rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss − entropy_coeff · entropy (+ kl_coef · KL to the reference when kl_coef > 0).

    `old_log_probs=None` is the on-policy shortcut (one epoch over one mini-batch): this forward's detached
    log-probs are the old ones, so the ratio is 1 and its gradient the policy gradient. `loss_params`: the policy
    loss's params dataclass (verl.config.ActorConfig.loss_params), passed when the loss declares one;
    `rollout_is_weights` [B, R]: rollout-correction weights on the policy loss only.
    """
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    extra = {} if loss_params is None else {"params": loss_params}
    out = get_policy_loss(policy_loss)(log_probs, old, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                       clip_c=clip_c, agg=agg, rollout_is_weights=rollout_is_weights, **extra)
    loss = out.loss
    stats = {"actor/pg_loss": out.loss.detach(), "actor/pg_clipfrac": out.pg_clipfrac.detach(),
             "actor/pg_clipfrac_lower": out.pg_clipfrac_lower.detach(), "actor/ppo_kl": out.ppo_kl.detach(),
             "actor/entropy": agg_loss(entropy.detach(), mask, "token-mean")}
    if entropy_coeff:
        loss = loss - entropy_coeff * agg_loss(entropy, mask, agg)
    if ref_log_probs is not None:
        stats["actor/kl"] = agg_loss((log_probs - ref_log_probs).detach(), mask, "token-mean")
        if kl_coef:
            kl = kl_loss(kl_type, log_probs, ref_log_probs, mask, agg)
            loss = loss + kl_coef * kl
            stats["actor/kl_loss"] = kl.detach()
    return loss, stats


def critic_loss(values: torch.Tensor, mask: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
                cliprange: float, agg: Aggregation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (values within ±cliprange of the old ones)."""
    out = value_loss(values, old_values, returns, mask, cliprange, agg=agg)
    return out.loss, {"critic/vf_loss": out.loss.detach(), "critic/vf_clipfrac": out.vf_clipfrac.detach()}


@torch.no_grad()
def rollout_mismatch(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the training engine's, with the
    same weights: mean and max |Δ|, the KL(rollout ‖ train) estimate k3 = E[r − 1 − log r] (r = p_train /
    p_rollout, sampled from the rollout), and the share of tokens with |Δ| > MISMATCH_THRESHOLD."""
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return {"rollout/mismatch_mean": 0.0, "rollout/mismatch_max": 0.0, "rollout/mismatch_kl": 0.0,
                "rollout/mismatch_frac": 0.0}
    delta = (train_log_probs.double() - rollout_log_probs.double())[valid]
    k3 = delta.exp() - 1 - delta
    return {"rollout/mismatch_mean": float(delta.abs().mean()), "rollout/mismatch_max": float(delta.abs().max()),
            "rollout/mismatch_kl": float(k3.mean()),
            "rollout/mismatch_frac": float((delta.abs() > MISMATCH_THRESHOLD).double().mean())}
