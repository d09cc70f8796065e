"""Rewards: a registry of rule-based functions (gsm8k, arithmetic, counting, upstream verl's data-source rules, your
own, in our signature or verl's compute_score) and a reward model."""

from verl.rewards import rule_based  # noqa: F401  (registers the built-in rewards)
from verl.rewards import by_source  # noqa: F401  (registers by_data_source, gsm8k_strict, math, math_dapo)
from verl.rewards.by_source import DATA_SOURCES, check_sources, reward_for_source
from verl.rewards.registry import (convention, get_reward, list_rewards, load_file_ref, register_reward, score_batch,
                                   score_samples)
from verl.rewards.rule_based import extract_gsm8k_answer

__all__ = ["DATA_SOURCES", "check_sources", "convention", "get_reward", "list_rewards", "load_file_ref",
           "register_reward", "reward_for_source", "score_batch", "score_samples", "extract_gsm8k_answer"]
