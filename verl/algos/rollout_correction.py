"""Rollout correction: importance weights and rejection for the mismatch between the rollout engine's sampling
distribution (mu, its log-probs of the sampled tokens) and the training engine's old policy (pi_old).

    corr = rollout_correction(old_log_probs, rollout_log_probs, response_mask, cfg.algorithm.rollout_correction)
    loss = policy_loss(..., response_mask=response_mask * corr.keep, rollout_is_weights=corr.weights)

With delta_t = clamp(log pi_old - log mu, +-20) on valid tokens (a bound against exp overflow only):

- truncated IS (`is_level`): token w_t = min(exp(delta_t), C); sequence w_b = min(exp(sum_t delta_t), C) on every
  token of b (computed in log space, so a long sequence's product never overflows). Weights are constants (no
  gradient) that multiply the per-token policy loss; padding gets 1.
- masked IS / rejection (`rejection_level`), bounds [lower, upper] on a ratio: token exp(delta_t); sequence
  exp(sum_t delta_t); geometric exp(mean_t delta_t). A token outside the bounds, or every token of a sequence
  outside them, leaves the loss mask, so the aggregation's token / sequence counts exclude it too (as upstream
  verl, which rewrites response_mask). Advantages are computed before and keep the rejected responses in their
  group baselines.
- bypass: the rollout log-probs are the old log-probs (no recomputation), so PPO's own ratio pi_theta / mu does
  the correction; weights and rejection would then be identically 1 / keep-all, so bypass excludes them.

Plain PyTorch: a few [B, T] elementwise ops and row sums, once per step. Metrics (floats, over this batch's
valid tokens): rollout_corr/is_weight_{mean,max,min}, rollout_corr/is_truncated_frac (share of tokens whose
weight hit C), rollout_corr/rejected_frac (share of tokens rejected), rollout_corr/rejected_seq_frac (share of
sequences with a rejected token).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from verl.ops.checks import check_bt, check_name, valid_mask

__all__ = ["IS_LEVELS", "REJECTION_LEVELS", "RolloutCorrection", "is_weights", "rejection_keep", "rollout_correction"]

IS_LEVELS = ("none", "token", "sequence")
REJECTION_LEVELS = ("none", "token", "sequence", "geometric")
_SAFETY = 20.0


class RolloutCorrection(NamedTuple):
    """weights: [B, T] detached IS weights (None without is_level); keep: [B, T] bool, valid and not rejected;
    metrics: the step's rollout_corr/* floats."""

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]


def _delta(old_log_probs, rollout_log_probs, mask):
    check_bt(old_log_probs, mask, "rollout_correction", "old_log_probs")
    if rollout_log_probs.shape != old_log_probs.shape:
        raise ValueError(f"rollout_correction: `rollout_log_probs` must have the shape of `old_log_probs` "
                         f"{tuple(old_log_probs.shape)}, got {tuple(rollout_log_probs.shape)}")
    valid = valid_mask(mask)
    d = torch.clamp(old_log_probs.detach().double() - rollout_log_probs.detach().double(), -_SAFETY, _SAFETY)
    return torch.where(valid, d, 0.0), valid


@torch.no_grad()
def is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
               level: str, cap: float) -> torch.Tensor:
    """Truncated IS weights [B, T] (dtype of old_log_probs, 1 on padding): token min(pi_old / mu, cap) or the
    sequence's min(prod_t pi_old / mu, cap) on each of its tokens."""
    check_name(level, IS_LEVELS[1:], "rollout_correction.is_level")
    if not cap > 0:
        raise ValueError(f"rollout_correction: the IS cap must be > 0, got {cap}")
    d, valid = _delta(old_log_probs, rollout_log_probs, response_mask)
    log_w = d if level == "token" else d.sum(-1, keepdim=True).expand_as(d)
    w = torch.exp(torch.clamp(log_w, max=math.log(cap)))
    return torch.where(valid, w, 1.0).to(old_log_probs.dtype)


@torch.no_grad()
def rejection_keep(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                   level: str, lower: float, upper: float) -> torch.Tensor:
    """[B, T] bool: valid tokens whose ratio (token, sequence product or geometric mean) is in [lower, upper]."""
    check_name(level, REJECTION_LEVELS[1:], "rollout_correction.rejection_level")
    if not 0 <= lower < upper:
        raise ValueError(f"rollout_correction: rejection bounds need 0 <= lower < upper, got [{lower}, {upper}]")
    d, valid = _delta(old_log_probs, rollout_log_probs, response_mask)
    if level == "token":
        stat = d
    else:
        stat = d.sum(-1, keepdim=True)
        if level == "geometric":
            stat = stat / valid.sum(-1, keepdim=True).clamp(min=1)
        stat = stat.expand_as(d)
    lo = math.log(lower) if lower > 0 else -math.inf
    return valid & (stat >= lo) & (stat <= math.log(upper))


@torch.no_grad()
def _metrics(old_log_probs, rollout_log_probs, response_mask, weights, keep, cap) -> dict[str, float]:
    valid = valid_mask(response_mask)
    n = int(valid.sum())
    seqs = valid.any(-1)
    out = {"rollout_corr/rejected_frac": float((valid & ~keep).sum()) / max(n, 1),
           "rollout_corr/rejected_seq_frac": float(((valid & ~keep).any(-1) & seqs).sum()) / max(int(seqs.sum()), 1)}
    if weights is not None:
        # a truncated weight is the cap rounded to the weights' dtype (float32 1.3 < double 1.3): compare in it
        cap = float(torch.tensor(cap, dtype=weights.dtype))
        w = weights.double()[valid]
        empty = w.numel() == 0
        out.update({"rollout_corr/is_weight_mean": 1.0 if empty else float(w.mean()),
                    "rollout_corr/is_weight_max": 1.0 if empty else float(w.max()),
                    "rollout_corr/is_weight_min": 1.0 if empty else float(w.min()),
                    "rollout_corr/is_truncated_frac": 0.0 if empty else float((w >= cap).double().mean())})
    return out


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       cfg) -> RolloutCorrection:
    """Weights, kept tokens and metrics for one step under `cfg` (verl.config.RolloutCorrectionConfig)."""
    weights = None
    if cfg.is_level not in ("none", "auto"):
        weights = is_weights(old_log_probs, rollout_log_probs, response_mask, cfg.is_level, cfg.is_cap)
    if cfg.rejection_level != "none":
        keep = rejection_keep(old_log_probs, rollout_log_probs, response_mask, cfg.rejection_level,
                              cfg.rejection_lower, cfg.rejection_upper)
    else:
        keep = valid_mask(response_mask).clone()
    return RolloutCorrection(weights, keep, _metrics(old_log_probs, rollout_log_probs, response_mask, weights, keep,
                                                     cfg.is_cap))
