"""The PPO step as a dataflow — this file is the algorithm.

    generate → reward → old log-probs, reference log-probs, values → token rewards (KL in reward)
             → advantage → update critic → update actor → sync weights

GRPO, Dr.GRPO, RLOO, REINFORCE++ and ReMax are the same flow with another advantage node and no critic
(`algorithm.adv_estimator`, any estimator registered in verl.algos); the reference node appears when a KL term
needs it. Workers arrive as inputs (`rollout`, `reward_fn`, `actor`, `ref`, `critic`), so engines and
placement change without touching this file.
"""

from __future__ import annotations

from verl import DataflowNode, build_dataflow
from verl.config.ppo import PPOConfig
from verl.trainer import algorithms as algo
from verl.utils.distributed import mean_across_ranks


@DataflowNode(input_keys=["prompts", "rollout"], output_keys=["batch"])
def generate(prompts, rollout):
    return rollout.generate(prompts)


@DataflowNode(input_keys=["prompts", "rollout", "reward_fn"], output_keys=["baseline_scores"])
def generate_baseline(prompts, rollout, reward_fn):
    """ReMax: the greedy response's reward is each prompt's baseline."""
    greedy = rollout.generate(prompts, n=1, greedy=True)
    return reward_fn.score(greedy).repeat_interleave(rollout.cfg.n).to(greedy.response_mask.device)


@DataflowNode(input_keys=["batch", "reward_fn"], output_keys=["scores"])
def reward(batch, reward_fn):
    return reward_fn.score(batch).to(batch.response_mask.device)


@DataflowNode(input_keys=["batch", "actor", "on_policy"], output_keys=["old_log_probs"])
def old_log_prob(batch, actor, on_policy):
    """None when the update is on-policy (one epoch, one mini-batch): its first forward gives them."""
    return None if on_policy else actor.compute_log_probs(batch)[0]


@DataflowNode(input_keys=["batch", "ref"], output_keys=["ref_log_probs"])
def ref_log_prob(batch, ref):
    return ref.compute_log_probs(batch)[0]


@DataflowNode(input_keys=["batch", "critic"], output_keys=["values"])
def values(batch, critic):
    return critic.compute_values(batch)


@DataflowNode(input_keys=["batch", "scores"], output_keys=["token_rewards", "kl_metrics"])
def token_rewards(batch, scores):
    return algo.token_level_rewards(scores, batch.response_mask), {}


@DataflowNode(input_keys=["batch", "scores", "old_log_probs", "ref_log_probs", "kl_ctrl", "algo_cfg"],
              output_keys=["token_rewards", "kl_metrics"])
def kl_in_reward(batch, scores, old_log_probs, ref_log_probs, kl_ctrl, algo_cfg):
    mask = batch.response_mask
    kl = algo.kl_penalty(old_log_probs, ref_log_probs, algo_cfg.kl_penalty) * mask
    rewards = algo.token_level_rewards(scores, mask) - kl_ctrl.value * kl
    metrics = {"actor/kl": float(kl.sum() / mask.sum().clamp(min=1)), "actor/kl_coef": kl_ctrl.value}
    # every rank must move its controller identically, so it sees the KL of the whole batch
    kl_ctrl.update(mean_across_ranks(float(kl.sum(-1).mean())), n_steps=len(batch))
    return rewards, metrics


@DataflowNode(input_keys=["batch", "token_rewards", "values", "algo_cfg"], output_keys=["advantages", "returns"])
def gae_advantage(batch, token_rewards, values, algo_cfg):
    return algo.advantages("gae", token_rewards, batch.response_mask, values=values, gamma=algo_cfg.gamma,
                           lam=algo_cfg.lam)


@DataflowNode(input_keys=["batch", "token_rewards", "baseline_scores"], output_keys=["advantages"])
def remax_advantage(batch, token_rewards, baseline_scores):
    return algo.advantages("remax", token_rewards, batch.response_mask, baseline=baseline_scores)[0]


@DataflowNode(input_keys=["batch", "token_rewards", "algo_cfg"], output_keys=["advantages"])
def group_advantage(batch, token_rewards, algo_cfg):
    """Critic-free estimators (grpo, dr_grpo, rloo, reinforce_plus_plus, ...): responses of one prompt form a group."""
    return algo.advantages(algo_cfg.adv_estimator, token_rewards, batch.response_mask, group=batch.group,
                           gamma=algo_cfg.gamma, norm_by_std=algo_cfg.norm_adv_by_std_in_grpo)[0]


@DataflowNode(input_keys=["batch", "critic", "values", "returns"], output_keys=["critic_metrics"])
def update_critic(batch, critic, values, returns):
    return critic.update(batch, values, returns)


@DataflowNode(input_keys=["batch", "actor", "old_log_probs", "advantages", "ref_log_probs", "update_actor_now"],
              output_keys=["actor_metrics"])
def update_actor(batch, actor, old_log_probs, advantages, ref_log_probs, update_actor_now):
    return actor.update(batch, old_log_probs, advantages, ref_log_probs) if update_actor_now else {}


@DataflowNode(input_keys=["actor", "rollout", "actor_metrics"], output_keys=["sync_bytes"])
def sync_weights(actor, rollout, actor_metrics):
    return rollout.sync_weights(actor)


ADVANTAGE_NODES = {"gae": gae_advantage, "remax": remax_advantage}


def ppo_nodes(cfg: PPOConfig) -> list:
    """The nodes of the configured algorithm, in reading order."""
    est = cfg.algorithm.adv_estimator
    nodes = [generate, reward, old_log_prob]
    nodes += [ref_log_prob] if cfg.needs_ref else []
    nodes += [values] if cfg.needs_critic else []
    nodes += [generate_baseline] if est == "remax" else []
    nodes += [kl_in_reward if cfg.algorithm.use_kl_in_reward else token_rewards,
              ADVANTAGE_NODES.get(est, group_advantage)]
    nodes += [update_critic] if cfg.needs_critic else []
    return nodes + [update_actor, sync_weights]


def build_ppo_dataflow(cfg: PPOConfig):
    """Every node runs on every rank (data parallel); the engine names show up in node contexts and traces."""
    nodes = ppo_nodes(cfg)
    train_engine = cfg.actor.engine
    engines = {"generate": "torch", "generate_baseline": "torch", "sync_weights": train_engine,
               "reward": "rule" if cfg.reward.type == "rule" else "torch", "old_log_prob": train_engine,
               "ref_log_prob": train_engine, "values": train_engine, "update_critic": train_engine,
               "update_actor": train_engine}
    names = {n.name for n in nodes}
    return build_dataflow(nodes=nodes, configs={k: {"engine": v} for k, v in engines.items() if k in names})
