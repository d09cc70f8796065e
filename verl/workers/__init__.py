"""Workers the PPO dataflow's nodes call: actor, reference, critic, rollout and reward, on a training engine."""

from verl.workers.actor import ActorWorker, ReferenceWorker, response_logprobs
from verl.workers.batch import RolloutBatch
from verl.workers.critic import CriticWorker, ValueModel
from verl.workers.engine import TorchEngine
from verl.workers.reward import ModelRewardWorker, RuleRewardWorker, build_reward
from verl.workers.rollout import HFRollout, build_rollout

__all__ = ["ActorWorker", "ReferenceWorker", "response_logprobs", "RolloutBatch", "CriticWorker", "ValueModel",
           "TorchEngine", "ModelRewardWorker", "RuleRewardWorker", "build_reward", "HFRollout", "build_rollout"]
