"""verl's typed configs: one dataclass tree per job, loaded from YAML plus dotted overrides.

The job's classes (verl.config.ppo) load on first use, so that engine configs elsewhere (verl.rollout.config)
can build on verl.config.base while the job's tree includes them."""

from verl.config.base import apply_overrides, describe, field_docs, from_dict, load_config, load_yaml, to_dict

_PPO = ("MegatronConfig", "ActorConfig", "FSDPConfig", "AlgorithmConfig", "CriticConfig", "DataConfig",
        "KLControlConfig", "ModelConfig", "OptimConfig", "PPOConfig", "RewardConfig", "RolloutConfig",
        "TinyModelConfig", "TrainerConfig", "ValConfig", "WarmupConfig")

__all__ = ["apply_overrides", "describe", "field_docs", "from_dict", "load_config", "load_yaml", "to_dict", *_PPO]


def __getattr__(name: str):
    if name in _PPO:
        from verl.config import ppo
        return getattr(ppo, name)
    raise AttributeError(f"module 'verl.config' has no attribute {name!r}")
