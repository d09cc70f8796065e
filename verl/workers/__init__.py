"""Workers the PPO dataflow's nodes call — actor (and reference), critic, rollout and reward — on a training
engine (`TorchEngine`, `FSDPEngine`, or `verl.workers.megatron.MegatronEngine`) behind one set of calls."""

from verl.workers.actor import ActorWorker
from verl.workers.batch import RolloutBatch, batch_from_outputs
from verl.workers.critic import CriticWorker, ValueModel
from verl.workers.engine import TorchEngine
from verl.workers.fsdp import FSDPEngine
from verl.workers.reward import ModelRewardWorker, RewardWorker, RuleRewardWorker, build_reward
from verl.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "FSDPEngine", "ModelRewardWorker", "RewardWorker", "RolloutBatch",
           "RolloutWorker", "RuleRewardWorker", "TorchEngine", "ValueModel", "batch_from_outputs", "build_reward"]
