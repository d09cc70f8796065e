"""Policy losses, selected by name: `get_policy_loss("vanilla")(logprob, old_logprob, advantages, response_mask)`.

Calling convention (all [B, T]; gradients flow to `logprob` only):

    fn(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
       agg="token-mean" | Aggregation(...), rollout_is_weights=None [B, T], params=<its params dataclass>)
       -> PolicyLossOutput(loss 0-d, pg_clipfrac, pg_clipfrac_lower, ppo_kl)

`agg` is an aggregation mode name (see verl.algos.AGG_MODES) or a verl.ops.Aggregation carrying the step's
global token / sequence counts and the data-parallel size. `rollout_is_weights` are detached per-token
importance weights from rollout correction (verl.algos.rollout_correction) that multiply the per-token loss
before aggregation. A loss with its own hyperparameters declares a dataclass (`params=`) at registration; the
trainer builds it from `actor.policy_loss_params` (unknown keys are config errors) and passes it as `params`.
The built-ins vanilla, gspo and reinforce are single fused kernels (loss, aggregation and statistics in one
pass; gradient in one pass); the others are plain PyTorch (verl/algos/pg_losses.py). Add one with:

    @register_policy_loss("my_loss", params=MyParams)
    def my_loss(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
                agg="token-mean", rollout_is_weights=None, params=MyParams()): ...   # e.g. via verl.algos.agg_loss
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl.registry import Registry
from verl.errors import VerlConfigError
from verl.ops.losses import PolicyLossOutput, policy_loss

__all__ = ["CLIP_READS", "POLICY_LOSS_FNS", "PolicyLossInfo", "get_policy_loss",
           "policy_loss_info", "register_policy_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossInfo:
    """What a policy loss declares at registration."""

    params: type | None = None
    """The dataclass of its own hyperparameters (built from actor.policy_loss_params), or None."""
    clip: str = "ratio"
    """How it reads the actor's clip_ratio_low / high (/ c), as upstream verl does: "ratio" (the PPO clip of the
    ratio to [1 - low, 1 + high], low < 1; dual clip c), "weight" (the same bounds on a stop-gradient weight, any
    low >= 0: CISPO), "divergence" (trust-region thresholds on p - p_old or a binary KL, c the IS truncation:
    DPPO), "log_ratio" (bounds on logp - old: GMPO), or "none"."""
    agg: str | None = None
    """The aggregation it always uses, whatever actor.loss_agg_mode says (None: that mode)."""
    upstream: str = ""
    """How it deliberately differs from upstream verl's loss of the same name, and why ('' when it does not)."""


CLIP_READS = {"ratio": "clip_ratio_low / high bound the ratio to [1 - low, 1 + high] (low < 1), clip_ratio_c is "
                       "the dual clip",
              "weight": "clip_ratio_low / high bound the stop-gradient weight to [1 - low, 1 + high] (any low >= 0)",
              "divergence": "clip_ratio_low / high are the divergence thresholds, clip_ratio_c truncates the IS "
                            "ratio",
              "log_ratio": "clip_ratio_low / high bound logp - old to [-low, high]",
              "none": "reads no clip_ratio_*"}
"""How each `PolicyLossInfo.clip` kind reads the actor's clip settings (printed by `verl algos`)."""

POLICY_LOSS_FNS: Registry = Registry("policy loss", required=(
    "logprob", "old_logprob", "advantages", "response_mask", "clip_low", "clip_high", "clip_c", "agg",
    "rollout_is_weights"), meta_type=PolicyLossInfo)


def register_policy_loss(name: str, *aliases: str, params: type | None = None, clip: str = "ratio",
                         agg: str | None = None, upstream: str = ""):
    """Decorator registering a policy loss under `name` (and aliases); `params`: its hyperparameter dataclass;
    `clip`, `agg`, `upstream`: see PolicyLossInfo."""
    if params is not None and not dataclasses.is_dataclass(params):
        raise VerlConfigError(f"policy loss {name!r}: `params` must be a dataclass type, got {params!r}")
    if clip not in ("ratio", "weight", "divergence", "log_ratio", "none"):
        raise VerlConfigError(f"policy loss {name!r}: clip={clip!r} is not ratio, weight, divergence, log_ratio "
                              f"or none")
    return POLICY_LOSS_FNS.register(name, *aliases, params=params, clip=clip, agg=agg, upstream=upstream)


def get_policy_loss(name: str):
    """The policy loss registered as `name`; unknown names list the known ones."""
    return POLICY_LOSS_FNS.get(name)


def policy_loss_info(name: str) -> PolicyLossInfo:
    """What policy loss `name` declared (its params dataclass)."""
    return POLICY_LOSS_FNS.meta(name)


def _fused(loss_type: str):
    def fn(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
           agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
        # These losses are positively homogeneous in the advantage (every branch is -A times a function of the
        # ratio, and the branch taken depends on sign(A) only), so weighting a token's loss by w > 0 is exactly
        # scaling its advantage by w: the fused kernel needs no weight input.
        adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights
        return policy_loss(logprob, old_logprob, adv, response_mask, loss_type, clip_low=clip_low,
                           clip_high=clip_high, clip_c=clip_c, agg=agg)
    fn.__name__ = fn.__qualname__ = loss_type
    return fn


vanilla = register_policy_loss("vanilla", "ppo")(_fused("vanilla"))
vanilla.__doc__ = ("PPO clip (fused kernel): ratio = exp(clamp(logp - old, +-20)), clip to [1 - clip_low, 1 + "
                   "clip_high], dual clip -A * clip_c bounding negative-advantage tokens.")
gspo = register_policy_loss("gspo", upstream="the policy term is aggregated by actor.loss_agg_mode (upstream forces "
                            "seq-mean-token-mean on it): one mode for every term keeps the fused loss head; set "
                            "actor.loss_agg_mode=seq-mean-token-mean, as upstream's GSPO examples do")(_fused("gspo"))
gspo.__doc__ = ("GSPO (fused kernel): the PPO clip on the length-normalised sequence ratio exp(mean_t(logp - old)), "
                "token gradient.")
reinforce = register_policy_loss("reinforce", clip="none")(_fused("reinforce"))
reinforce.__doc__ = "Unclipped -A * ratio (fused kernel; on-policy: the REINFORCE gradient -A grad logp)."
