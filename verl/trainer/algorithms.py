"""The seam between the PPO flow and verl's RL kernels (`verl.algos`, `verl.ops`): the few calls the workers
and nodes make, with the trainer's conventions (masks [B, R] over response tokens, `group` = prompt index).

Estimators, policy losses and KL penalties are looked up by name in verl.algos' registries, so a newly
registered one is usable from config without touching the trainer.
"""

from __future__ import annotations

import torch

import verl.ops
from verl.algos import Aggregation, agg_loss, get_advantage, get_kl, get_policy_loss, value_loss as _value_loss


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Places each response's score [B] on its last real token → [B, R]."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = scores.float()
    return out * response_mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, R] (k1, abs, k2, k3 or any registered name)."""
    return get_kl(kind)(logp, ref_logp)


def advantages(name: str, token_rewards, response_mask, *, group=None, values=None, baseline=None,
               gamma: float = 1.0, lam: float = 1.0, norm_by_std: bool = True):
    """(advantages, returns) [B, R] from the registered estimator `name`."""
    out = get_advantage(name)(token_rewards, response_mask, values=values, index=group, baseline=baseline,
                              gamma=gamma, lam=lam, norm_by_std=norm_by_std)
    return out.advantages, out.returns


def policy_loss(name: str, logp, old_logp, adv, response_mask, *, clip_low, clip_high, clip_c, agg: Aggregation):
    """(loss 0-d, clip fraction, approx KL to the rollout policy) of policy loss `name`."""
    out = get_policy_loss(name)(logp, old_logp, adv, response_mask, clip_low=clip_low, clip_high=clip_high,
                                clip_c=clip_c, agg=agg)
    return out.loss, out.pg_clipfrac, out.ppo_kl


def value_loss(values, old_values, returns, response_mask, *, cliprange: float, agg: Aggregation):
    out = _value_loss(values, old_values, returns, response_mask, cliprange, agg=agg)
    return out.loss, out.vf_clipfrac


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation | str) -> torch.Tensor:
    return agg_loss(loss, mask, agg)


# Below this vocabulary the [tokens, vocab] logits are small and one GEMM beats the chunked fused LM head.
FUSED_LM_HEAD_MIN_VOCAB = 4096


def response_logprob_entropy(hidden: torch.Tensor, lm_head: torch.nn.Linear, targets: torch.Tensor,
                             temperature: float):
    """log p(target) and entropy [B, R] from hidden states and the LM head. For real vocabularies the fused
    kernel computes the logits chunk by chunk, so [tokens, vocab] logits are never stored whole."""
    if lm_head.bias is not None or lm_head.weight.shape[0] < FUSED_LM_HEAD_MIN_VOCAB:
        return verl.ops.logprob_entropy(lm_head(hidden), targets, temperature)
    return verl.ops.linear_logprob_entropy(hidden, lm_head.weight, targets, temperature)
