"""The numerical pieces the PPO flow calls: advantage estimators, KL penalties, policy / value losses and
loss aggregation. One seam: `verl.algos` (registered estimators and fused kernels) when present; the
pure-PyTorch versions below otherwise.

Shapes: `scores` [B] (one scalar reward per response), token tensors [B, R] over response tokens,
`response_mask` [B, R] (1 = real token), `group` [B] int (responses of one prompt share a group id).
"""

from __future__ import annotations

import torch

from verl.ops import masked_mean, masked_whiten

EPS = 1e-6


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference: k1, abs, k2 (mse) or k3 (low-variance)."""
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        neg = -diff
        return (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}; choose k1, abs, k2 or k3")


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Places each response's score on its last real token."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = scores.float()
    return out * response_mask


def _group_stats(scores: torch.Tensor, group: torch.Tensor):
    ids, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(ids), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = sums / counts
    sq = torch.zeros(len(ids), dtype=scores.dtype).index_add_(0, inverse, (scores - mean[inverse]).square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))  # unbiased, like torch.std
    return inverse, counts, sums, mean, std


def grpo_advantage(scores, response_mask, group, *, norm_by_std: bool = True):
    inverse, _, _, mean, std = _group_stats(scores.float(), group)
    adv = scores.float() - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + EPS)
    return adv[:, None] * response_mask


def rloo_advantage(scores, response_mask, group):
    inverse, counts, sums, _, _ = _group_stats(scores.float(), group)
    n = counts[inverse].float()
    baseline = (sums[inverse] - scores.float()) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, scores.float() - baseline, torch.zeros_like(baseline))
    return adv[:, None] * response_mask


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * response_mask[:, t]
        returns[:, t] = running
    return returns * response_mask


def reinforce_pp_advantage(token_rewards, response_mask, gamma: float):
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask, returns


def remax_advantage(scores, baseline_scores, response_mask):
    return (scores.float() - baseline_scores.float())[:, None] * response_mask


def gae_advantage(token_rewards, values, response_mask, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens; padding is skipped (carries the running GAE)."""
    B, R = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype)
    running = torch.zeros(B, dtype=values.dtype)
    for t in reversed(range(R)):
        m = response_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = m * new_running + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = running
    returns = adv + values
    return masked_whiten(adv, response_mask) * response_mask, returns * response_mask


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """Reduces per-token losses [B, R] to a scalar: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (Dr.GRPO: token sums divided by a constant length)."""
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    seq_sum = (loss * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (seq_sum / float(norm_len or loss.shape[-1])).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


def policy_loss(logp, old_logp, advantages, response_mask, *, clip_low: float, clip_high: float, clip_c: float,
                agg_mode: str):
    """PPO clipped surrogate with dual clip; returns (loss, clip_fraction, approx_kl)."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(-advantages * clip_c, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    loss = agg_loss(per_token, response_mask, agg_mode)
    with torch.no_grad():
        clipfrac = masked_mean((pg2 > pg1).float(), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, clipfrac, approx_kl


def value_loss(values, old_values, returns, response_mask, *, cliprange: float):
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v) - R)^2), token-mean; returns (loss, clip_fraction)."""
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    l1, l2 = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(l1, l2), response_mask)
    return loss, masked_mean((l2 > l1).float(), response_mask)


def logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log p(target) and the entropy of softmax(logits / temperature), per position."""
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy
