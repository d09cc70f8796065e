"""Writes an example trace of a PPO-shaped dataflow on 4 gloo CPU ranks with split placement.

    python benchmarks/dataflow/example_trace.py      # -> benchmarks/results/dataflow_example_trace.json

generate runs on ranks 0-1 (engine "vllm"), reward on ranks 2-3 (engine "rule"), an injected
safe_reward_filter follows reward, and the training-side nodes (old_logprob, ref, values, advantage,
update_critic, update_actor, sync_weights) run colocated on all four ranks. Open the file in
https://ui.perfetto.dev (or chrome://tracing): one row per rank, one bar per node, "redistribute" bars where
the rollout batch moves between rank sets. The second of two steps is traced (the first sets up groups).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from verl import CustomNode, DataflowNode, build_dataflow, inject_node  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.testing import run_distributed  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "results", "dataflow_example_trace.json")
VOCAB, HIDDEN, RESP = 64, 32, 8


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB))


@DataflowNode(input_keys=["prompts", "actor"], output_keys=["rollout"])
def generate(prompts, actor, ctx):
    ids = prompts["input_ids"]
    with torch.no_grad():
        for _ in range(RESP):
            nxt = torch.distributions.Categorical(logits=actor(ids[:, -1])).sample()[:, None]
            ids = torch.cat([ids, nxt], dim=1)
    batch = prompts.clone()
    batch["responses"] = ids[:, -RESP:]
    batch["full"] = ids
    return batch


@DataflowNode(input_keys=["rollout"], output_keys=["reward"])
def reward(rollout):
    return (rollout["responses"] % 2 == 0).float().mean(-1)  # a rule: share of even tokens


@CustomNode()
def safe_reward_filter(rollout, reward, threshold=0.3):
    keep = reward > threshold
    return dict(reward=reward * keep, kept=keep)


def _logprob(model, full):
    logits = model(full[:, :-1])
    return torch.log_softmax(logits, -1).gather(-1, full[:, 1:, None]).squeeze(-1)[:, -RESP:]


@DataflowNode(input_keys=["rollout", "actor"], output_keys=["old_log_probs"])
def old_logprob(rollout, actor):
    with torch.no_grad():
        return _logprob(actor, rollout["full"])


@DataflowNode(input_keys=["rollout", "ref_model"], output_keys=["ref_log_probs"])
def ref(rollout, ref_model):
    with torch.no_grad():
        return _logprob(ref_model, rollout["full"])


@DataflowNode(input_keys=["rollout", "critic"], output_keys=["values"])
def values(rollout, critic):
    with torch.no_grad():
        return critic(rollout["responses"]).mean(-1)


@DataflowNode(input_keys=["reward", "values", "old_log_probs", "ref_log_probs"], output_keys=["advantages", "returns"])
def advantage(reward, values, old_log_probs, ref_log_probs, kl_coef=0.05):
    r = reward[:, None] - kl_coef * (old_log_probs - ref_log_probs)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    return returns - values[:, None], returns


def _step(model, loss, ctx):
    loss.backward()
    for p in model.parameters():  # data-parallel gradient average over the node's ranks
        if p.grad is not None:
            dist.all_reduce(p.grad, group=ctx.process_group)
            p.grad /= ctx.dp_size
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad
                p.grad = None


@DataflowNode(input_keys=["rollout", "critic", "returns"], output_keys=["critic_loss"])
def update_critic(rollout, critic, returns, ctx):
    loss = ((critic(rollout["responses"]).mean(-1)[:, None] - returns) ** 2).mean()
    _step(critic, loss, ctx)
    return loss.detach()


@DataflowNode(input_keys=["rollout", "actor", "old_log_probs", "advantages"], output_keys=["actor_loss"])
def update_actor(rollout, actor, old_log_probs, advantages, ctx, clip=0.2):
    ratio = torch.exp(_logprob(actor, rollout["full"]) - old_log_probs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
    _step(actor, loss, ctx)
    return loss.detach()


@DataflowNode(input_keys=["actor", "actor_loss"], output_keys=["weights_version"])
def sync_weights(actor, actor_loss, ctx):
    return {"version": 1, "params": sum(p.numel() for p in actor.parameters()), "rank": ctx.rank}


def build():
    flow = build_dataflow(
        nodes=[generate, reward, old_logprob, ref, values, advantage, update_critic, update_actor, sync_weights],
        configs={"generate": dict(engine="vllm", device_map=[0, 1]),
                 "reward": dict(engine="rule", device_map=[2, 3]),
                 "old_logprob": dict(engine="megatron"), "ref": dict(engine="megatron"),
                 "values": dict(engine="megatron"), "update_critic": dict(engine="megatron"),
                 "update_actor": dict(engine="megatron"), "sync_weights": dict(replicated_outputs=["weights_version"])})
    return inject_node(base_dataflow=flow, node=safe_reward_filter, after="reward", before="advantage")


def _body(rank, world_size, path):
    torch.manual_seed(rank)
    ids = torch.randint(0, VOCAB, (8, 6))
    prompts = TensorDict({"input_ids": ids}, batch_size=[8])
    inputs = {"actor": _model(1), "ref_model": _model(1), "critic": _model(2)}
    if rank in (0, 1):
        inputs["prompts"] = prompts
    flow = build()
    flow.run(inputs)  # first step: process groups are created and gloo connects; trace the steady state
    out = flow.run(inputs, trace=path)
    return float(out["actor_loss"])


def main():
    path = os.path.abspath(OUT)
    losses = run_distributed(_body, world_size=4, args=(path,), timeout=180)
    print(f"wrote {path}; actor loss per rank {losses}")


if __name__ == "__main__":
    main()
