"""Policy losses, selected by name: `get_policy_loss("vanilla")(logprob, old_logprob, advantages, response_mask)`.

Calling convention (all [B, T]; gradients flow to `logprob` only):

    fn(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
       agg="token-mean" | Aggregation(...)) -> PolicyLossOutput(loss 0-d, pg_clipfrac, pg_clipfrac_lower, ppo_kl)

`agg` is an aggregation mode name (see verl.algos.AGG_MODES) or a verl.ops.Aggregation carrying the step's
global token / sequence counts and the data-parallel size. The built-ins are single fused kernels (loss,
aggregation and statistics in one pass; gradient in one pass). Add one with:

    @register_policy_loss("my_loss")
    def my_loss(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
                agg="token-mean"): ...   # e.g. a per-token loss passed through verl.algos.agg_loss
"""

from __future__ import annotations

from verl.algos.registry import Registry
from verl.ops.losses import PolicyLossOutput, policy_loss

__all__ = ["POLICY_LOSS_FNS", "register_policy_loss", "get_policy_loss"]

POLICY_LOSS_FNS: Registry = Registry("policy loss", required=(
    "logprob", "old_logprob", "advantages", "response_mask", "clip_low", "clip_high", "clip_c", "agg"))


def register_policy_loss(name: str, *aliases: str):
    """Decorator registering a policy loss under `name` (and aliases)."""
    return POLICY_LOSS_FNS.register(name, *aliases)


def get_policy_loss(name: str):
    """The policy loss registered as `name`; unknown names list the known ones."""
    return POLICY_LOSS_FNS.get(name)


def _fused(loss_type: str):
    def fn(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
           agg="token-mean") -> PolicyLossOutput:
        return policy_loss(logprob, old_logprob, advantages, response_mask, loss_type, clip_low=clip_low,
                           clip_high=clip_high, clip_c=clip_c, agg=agg)
    fn.__name__ = fn.__qualname__ = loss_type
    return fn


vanilla = register_policy_loss("vanilla", "ppo")(_fused("vanilla"))
vanilla.__doc__ = ("PPO clip: ratio = exp(clamp(logp - old, +-20)), clip to [1 - clip_low, 1 + clip_high], dual clip "
                   "-A * clip_c bounding negative-advantage tokens.")
gspo = register_policy_loss("gspo")(_fused("gspo"))
gspo.__doc__ = "GSPO: the PPO clip on the length-normalised sequence ratio exp(mean_t(logp - old)), token gradient."
reinforce = register_policy_loss("reinforce")(_fused("reinforce"))
reinforce.__doc__ = "Unclipped -A * ratio (on-policy: the REINFORCE gradient -A grad logp)."
