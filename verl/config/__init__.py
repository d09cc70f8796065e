"""verl's typed configs: one dataclass tree per job, loaded from YAML plus dotted overrides."""

from verl.config.base import apply_overrides, describe, field_docs, from_dict, load_config, load_yaml, to_dict
from verl.config.ppo import (
    MegatronConfig,
    ActorConfig,
    FSDPConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
    ValConfig,
    WarmupConfig,
)

__all__ = [
    "apply_overrides", "describe", "field_docs", "from_dict", "load_config", "load_yaml", "to_dict",
    "ActorConfig", "AlgorithmConfig", "FSDPConfig", "MegatronConfig", "CriticConfig", "DataConfig", "KLControlConfig", "ModelConfig", "OptimConfig",
    "PPOConfig", "RewardConfig", "RolloutConfig", "TinyModelConfig", "TrainerConfig", "ValConfig", "WarmupConfig",
]
