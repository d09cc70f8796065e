"""Rewards: a registry of rule-based functions (gsm8k, arithmetic, counting, your own) and a reward model."""

from verl.rewards import rule_based  # noqa: F401  (registers the built-in rewards)
from verl.rewards.registry import get_reward, list_rewards, register_reward, score_batch
from verl.rewards.rule_based import extract_gsm8k_answer

__all__ = ["get_reward", "list_rewards", "register_reward", "score_batch", "extract_gsm8k_answer"]
