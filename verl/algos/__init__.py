"""RL algorithms chosen by name from config: advantage estimators, policy losses, KL penalties, aggregation.

    from verl.algos import get_advantage, get_policy_loss, get_kl, kl_loss, agg_loss, Aggregation
    adv = get_advantage("grpo")(token_level_rewards, response_mask, index=uid)          # AdvantageResult
    out = get_policy_loss("vanilla")(logprob, old_logprob, adv.advantages, response_mask,
                                     clip_low=0.2, clip_high=0.28, agg="token-mean")     # PolicyLossOutput
    kl = kl_loss("low_var_kl", logprob, ref_logprob, response_mask)                     # 0-d
    ent = agg_loss(entropy, response_mask, "token-mean")                                 # entropy bonus term

Each kind is a small registry (`@register_advantage("name")`, `@register_policy_loss("name")`,
`@register_kl("name")`); the docstrings of the modules give the calling conventions and tensor shapes.
Aggregation modes are the kernel's fixed set AGG_MODES; pass an `Aggregation` for global token counts / DP size.
"""

from __future__ import annotations

from verl.algos.advantages import ADVANTAGES, AdvantageInfo, advantage_info, get_advantage, register_advantage
from verl.algos.kl import KLS, get_kl, kl_loss, register_kl
from verl.algos.objectives import ADDITIVE, actor_loss, critic_loss, rollout_mismatch
from verl.algos.policy_losses import (POLICY_LOSS_FNS, PolicyLossInfo, get_policy_loss,
                                      policy_loss_info, register_policy_loss)
from verl.algos import pg_losses  # noqa: F401  (registers cispo, sapo, gpg, dppo_*, clip_cov, kl_cov, geo_mean, dro)
from verl.algos.rollout_correction import RolloutCorrection, rollout_correction
from verl.registry import Registry
from verl.ops.checks import check_name
from verl.ops.losses import AGG_MODES, Aggregation, PolicyLossOutput, ValueLossOutput, agg_loss, value_loss
from verl.ops.rl import AdvantageResult

__all__ = ["ADDITIVE", "ADVANTAGES", "AGG_MODES", "AdvantageInfo", "actor_loss", "advantage_info", "critic_loss",
           "rollout_mismatch", "KLS", "POLICY_LOSS_FNS", "AdvantageResult", "Aggregation", "PolicyLossOutput",
           "Registry", "ValueLossOutput", "agg_loss", "check_agg_mode", "entropy_loss", "get_advantage", "get_kl",
           "get_policy_loss", "kl_loss", "register_advantage", "register_kl", "register_policy_loss", "value_loss",
           "PolicyLossInfo", "policy_loss_info", "RolloutCorrection",
           "rollout_correction"]


def check_agg_mode(mode: str) -> str:
    """Returns `mode` if it is a known aggregation mode, else raises VerlConfigError listing them."""
    return check_name(mode, AGG_MODES, "aggregation mode")


def entropy_loss(entropy, response_mask, agg: Aggregation | str = "token-mean"):
    """Entropy bonus term: per-token entropy [B, T] aggregated over the mask (0-d); subtract coef * it."""
    return agg_loss(entropy, response_mask, agg)
