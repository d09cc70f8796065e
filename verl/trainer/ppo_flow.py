"""The PPO step as a dataflow — this file is the algorithm.

    generate → reward → old log-probs, reference log-probs, values → token rewards (KL in reward)
             → advantage → update critic → update actor → sync weights

Asynchronous modes are the same nodes with the generated batches read from earlier runs (`trainer.mode`).
one_step_off: every node that consumes what the rollout made reads it with ``lag=1`` (a node config, see
`verl.dataflow.config.NodeConfig.lag`), so the rollout's ranks generate the next batch while the actor's ranks
train on an earlier one, and the weights move at the step boundary (sync_weights, which waits for both). async:
those nodes read it through a queue (``NodeConfig.queue``), which splits the flow into two stages that run at
their own pace: the rollout's ranks generate into the queue, the actor's ranks train on what it holds, and
publish_weights hands each new version to a background stream (`verl.workers.rollout.WeightStream`) that the
rollout takes from before each batch, waiting when it would exceed algorithm.max_staleness.

GRPO, Dr.GRPO, RLOO, REINFORCE++ and ReMax are the same flow with another advantage node and no critic: the
estimator's registration (`verl.algos.advantage_info`) says whether it needs a critic, a greedy baseline or
groups, and the flow takes the matching nodes, so registering an estimator never edits this file. Workers
arrive as inputs (`rollout`, `reward_fn`, `actor`, `ref`, `critic`), so engines and placement change without
touching it.
"""

from __future__ import annotations

import torch

from verl import DataflowNode, build_dataflow
from verl.dataflow import NodeConfig
from verl.algos import advantage_info, get_advantage, get_kl, rollout_mismatch
from verl.config.ppo import PPOConfig
from verl.distributed.collectives import mean_over
from verl.workers.rollout import sync_rollout_weights


@DataflowNode(input_keys=["prompts", "rollout", "seed", "rollout_version", "gen_stats"],
              output_keys=["batch", "gen_metrics"])
def generate(prompts, rollout, seed, rollout_version, gen_stats):
    """Each sample carries the policy version whose weights generated it (rollout/staleness): the version the
    rollout holds, or with partial rollouts the oldest of its tokens' versions. `gen_metrics` (the engine's
    own, and `gen_stats` from the trainer on the rollout's ranks) travel with the batch to the actor's ranks."""
    batch = rollout.generate(prompts, seed=seed)
    if batch.token_version is None:
        batch.weight_version = torch.full((len(batch),), rollout_version, dtype=torch.long)
    return batch, {**getattr(rollout.engine, "take_metrics", dict)(), **gen_stats}


@DataflowNode(input_keys=["prompts", "rollout", "seed"], output_keys=["baseline_batch"])
def generate_baseline(prompts, rollout, seed):
    """ReMax: one greedy response per prompt, whose reward is the prompt's baseline."""
    return rollout.generate(prompts, n=1, greedy=True, seed=seed)


@DataflowNode(input_keys=["baseline_batch", "reward_fn"], output_keys=["baseline_scores"])
def score_baseline(baseline_batch, reward_fn):
    return reward_fn.score(baseline_batch).to(baseline_batch.response_mask.device)


@DataflowNode(input_keys=["batch", "reward_fn"], output_keys=["scores", "reward_metrics"])
def reward(batch, reward_fn):
    """The weighted sum of the reward sources, and each source's statistics (reward/<source>/mean, std)."""
    scores, metrics = reward_fn.score_with_metrics(batch)
    return scores.to(batch.response_mask.device), metrics


@DataflowNode(input_keys=["batch", "actor"], output_keys=["old_log_probs", "mismatch_metrics"])
def old_log_prob(batch, actor, on_policy=False, bypass=False):
    """On-policy updates (one epoch, one mini-batch) get them, and the mismatch, from their own first forward;
    `bypass` (algorithm.rollout_correction.bypass) takes the rollout engine's instead."""
    if bypass:
        if batch.rollout_log_probs is None:
            raise ValueError("algorithm.rollout_correction.bypass needs the rollout engine's log-probs, and this "
                             "rollout returned none; set bypass=false")
        return batch.rollout_log_probs, {}
    if on_policy:
        return None, {}
    old = actor.compute_log_probs(batch)[0]
    rollout_lp = batch.rollout_log_probs
    return old, {} if rollout_lp is None else rollout_mismatch(old, rollout_lp, batch.response_mask)


@DataflowNode(input_keys=["batch", "ref"], output_keys=["ref_log_probs"])
def ref_log_prob(batch, ref):
    return ref.compute_log_probs(batch)[0]


@DataflowNode(input_keys=[], output_keys=["ref_log_probs"])
def no_reference():
    """No KL term in the loss or the reward: the update runs without reference log-probs."""
    return None


@DataflowNode(input_keys=["batch", "critic"], output_keys=["values"])
def values(batch, critic):
    return critic.compute_values(batch)


def _token_rewards(scores, mask):
    """Each response's score [B] on its last real token → [B, R]."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    out[torch.arange(len(scores)), (mask.sum(-1).long() - 1).clamp(min=0)] = scores.float()
    return out * mask


@DataflowNode(input_keys=["batch", "scores"], output_keys=["token_rewards", "kl_metrics"])
def token_rewards(batch, scores):
    return _token_rewards(scores, batch.response_mask), {}


@DataflowNode(input_keys=["batch", "scores", "old_log_probs", "ref_log_probs", "kl_ctrl", "algo_cfg"],
              output_keys=["token_rewards", "kl_metrics"])
def kl_in_reward(batch, scores, old_log_probs, ref_log_probs, kl_ctrl, algo_cfg, ctx):
    mask = batch.response_mask
    kl = get_kl(algo_cfg.kl_penalty)(old_log_probs, ref_log_probs) * mask
    rewards = _token_rewards(scores, mask) - kl_ctrl.value * kl
    metrics = {"actor/kl": float(kl.sum() / mask.sum().clamp(min=1)), "actor/kl_coef": kl_ctrl.value}
    # every rank must move its controller identically, so it sees the KL of the whole batch
    kl_ctrl.update(mean_over(ctx.process_group, float(kl.sum(-1).mean())), n_steps=len(batch))
    return rewards, metrics


@DataflowNode(input_keys=["batch", "token_rewards", "values", "algo_cfg"], output_keys=["advantages", "returns"])
def critic_advantage(batch, token_rewards, values, algo_cfg):
    """Estimators that need a critic (GAE): advantages, and the returns the critic trains on."""
    out = get_advantage(algo_cfg.adv_estimator)(token_rewards, batch.response_mask, values=values,
                                                gamma=algo_cfg.gamma, lam=algo_cfg.lam)
    return out.advantages, out.returns


@DataflowNode(input_keys=["batch", "token_rewards", "baseline_scores", "algo_cfg"], output_keys=["advantages"])
def baseline_advantage(batch, token_rewards, baseline_scores, algo_cfg):
    """Estimators against a greedy baseline (ReMax): each prompt's baseline, repeated for its responses."""
    n = len(batch) // len(baseline_scores)
    baseline = baseline_scores.repeat_interleave(n).to(batch.response_mask.device)
    return get_advantage(algo_cfg.adv_estimator)(token_rewards, batch.response_mask, baseline=baseline).advantages


@DataflowNode(input_keys=["batch", "token_rewards", "algo_cfg"], output_keys=["advantages"])
def group_advantage(batch, token_rewards, algo_cfg):
    """Critic-free estimators (grpo, dr_grpo, rloo, reinforce_plus_plus, ...): responses of one prompt form a group."""
    return get_advantage(algo_cfg.adv_estimator)(token_rewards, batch.response_mask, index=batch.group,
                                                 gamma=algo_cfg.gamma,
                                                 norm_by_std=algo_cfg.norm_adv_by_std_in_grpo).advantages


@DataflowNode(input_keys=["batch", "critic", "values", "returns", "step"], output_keys=["critic_metrics"])
def update_critic(batch, critic, values, returns, step):
    return critic.update(batch, values, returns, step=step)


@DataflowNode(input_keys=["batch", "actor", "old_log_probs", "advantages", "ref_log_probs", "step"],
              output_keys=["actor_metrics"])
def update_actor(batch, actor, old_log_probs, advantages, ref_log_probs, step, critic_warmup=0):
    """The critic trains alone for its first `critic_warmup` steps."""
    return actor.update(batch, old_log_probs, advantages, ref_log_probs, step=step) if step >= critic_warmup else {}


@DataflowNode(input_keys=["actor", "rollout", "actor_metrics"], output_keys=["sync_metrics"])
def sync_weights(actor, rollout, actor_metrics):
    """On the actor's ranks; with the rollout on its own ranks, on both sets (each rank holds one side, the other
    is None): the actor's ranks send, the rollout's receive."""
    return sync_rollout_weights(actor, rollout)


@DataflowNode(input_keys=["gen_metrics"], output_keys=["generation_metrics"])
def generation_metrics(gen_metrics):
    """What the rollout measured, on the actor's ranks, which log the step (in split placement and async the
    rollout's ranks are elsewhere; in async they are never in step with the actor's)."""
    return dict(gen_metrics)


@DataflowNode(input_keys=["actor", "actor_metrics", "step"], output_keys=["sync_metrics"])
def publish_weights(actor, actor_metrics, step):
    """trainer.mode=async: version step + 1 goes to the rollout's ranks in the background (`WeightStream`); the
    actor's ranks go on to the next batch at once."""
    return actor.weight_stream.publish(actor, step + 1)


def ppo_nodes(cfg: PPOConfig) -> list:
    """The nodes of the configured algorithm, in reading order. Nodes that only need the batch come first (the
    reward, the critic's values), so that in split placement the reward and critic ranks work on them while the
    actor's ranks compute old and reference log-probs."""
    info = advantage_info(cfg.algorithm.adv_estimator)
    nodes = [generate] + ([generate_baseline, score_baseline] if info.needs_baseline else []) + [reward]
    nodes += [values] if info.needs_critic else []
    nodes += [ref_log_prob if cfg.needs_ref else no_reference, old_log_prob]
    nodes += [kl_in_reward if cfg.algorithm.use_kl_in_reward else token_rewards]
    nodes += [critic_advantage, update_critic] if info.needs_critic else \
        [baseline_advantage if info.needs_baseline else group_advantage]
    return nodes + [generation_metrics, update_actor, publish_weights if cfg.streaming else sync_weights]


ROLE_OF = {"generate": "rollout", "generate_baseline": "rollout", "reward": "reward", "score_baseline": "reward",
           "ref_log_prob": "ref", "values": "critic", "update_critic": "critic"}
"""The role whose ranks run each node; every other node (old log-probs, token rewards, advantages, the actor
update) runs on the actor's ranks, and the weight sync on the actor's and the rollout's (`node_ranks`)."""


def node_ranks(node: str, roles: dict) -> tuple[int, ...]:
    """The ranks that run `node`: its role's, and for the weight sync both ends of the move."""
    ranks = roles[ROLE_OF.get(node, "actor")].ranks
    if node == "sync_weights":
        ranks = tuple(sorted(set(ranks) | set(roles["rollout"].ranks)))
    return ranks


def node_configs(cfg: PPOConfig, roles: dict) -> dict[str, NodeConfig]:
    """Each node's dataflow config, built from its role (`NodeConfig.from_role`: the role's ranks, engine and
    cpu_offload) plus its settings. This is the seed article's `*_config` dicts, derived from the job's roles."""
    settings = {"old_log_prob": {"on_policy": cfg.on_policy, "bypass": cfg.algorithm.rollout_correction.bypass},
                "update_actor": {"critic_warmup": cfg.critic.warmup_steps if cfg.needs_critic else 0}}
    out = {}
    nodes, lag = ppo_nodes(cfg), cfg.generation_lag
    generated = {k for n in nodes if ROLE_OF.get(n.name) == "rollout" for k in n.output_keys}
    for node in nodes:
        lagged = {k: lag for k in node.input_keys if k in generated} if ROLE_OF.get(node.name) != "rollout" else {}
        # async: the rollout runs ahead on its own, so batches queue up (at most `lag` waiting)
        reads = {"queue": {k: max(1, lag) for k in lagged}} if cfg.streaming and lagged else \
            {"lag": lagged} if lag and lagged else {}
        out[node.name] = NodeConfig.from_role(roles[ROLE_OF.get(node.name, "actor")],
                                              device_map=node_ranks(node.name, roles),
                                              settings=settings.get(node.name, {}),
                                              timeout_s=max(0.0, cfg.trainer.node_timeout_s), **reads)
    return out


def build_ppo_dataflow(cfg: PPOConfig, world_size: int = 1):
    """The configured algorithm's dataflow, each node on its role's ranks (`PPOConfig.roles`)."""
    # the rollout's weights change only once it has generated (implied by the keys in sync mode)
    return build_dataflow(nodes=ppo_nodes(cfg), configs=node_configs(cfg, cfg.roles(world_size)), world_size=world_size,
                          dependencies={"update_actor": ["generation_metrics"],  # one stage with the update
                                        **({} if cfg.streaming else {"sync_weights": ["generate"]})})
