"""The rollout on its own ranks (rollout.ranks disjoint from actor.ranks): the 3D-HybridEngine sends the actor's
weights from the actor's ranks to the rollout's each step, and the generated batch reaches the actor's ranks
through the dataflow's redistribution. On gloo: the run equals the same job with the rollout on the actor's
ranks, the rollout engine ends with the actor's weights bit for bit, and bad rank lists fail before any step."""

from __future__ import annotations

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.distributed import init_placement
from verl.errors import VerlConfigError
from verl.testing import run_distributed
from verl.trainer.ppo_trainer import PPOTrainer

from tests.trainer.conftest import TINY

BASE = [*TINY, "reward.name=tests.trainer.test_multiprocess:length_reward", "trainer.export_hf=false",
        "trainer.plot=false", "actor.optim.lr=1e-2", "algorithm.adv_estimator=grpo", "warmup.steps=0",
        "trainer.total_steps=2", "trainer.save_final=false", "trainer.placement=split"]
COMPARED = ("reward/mean", "actor/pg_loss", "advantage/mean", "response/length", "actor/entropy")


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _run(rank, world_size, overrides, out):
    trainer = PPOTrainer(load_config(PPOConfig, None, [*BASE, *overrides, f"trainer.output_dir={out}"]),
                         init_placement("cpu"))
    history = trainer.fit()
    actor = rollout = None
    if trainer.actor is not None:
        engine = trainer.actor.engine
        if hasattr(engine, "mesh"):  # FSDP2: the whole weights, gathered from the shards
            from torch.distributed.tensor import DTensor
            actor = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in engine.module.named_parameters()}
        else:
            actor = _params(engine.module)
    if trainer.rollout is not None:
        rollout = _params(trainer.rollout.engine.model)
    return {"actor": actor, "rollout": rollout, "history": history,
            "roles": sorted(n for n in ("actor", "rollout", "reward_fn") if getattr(trainer, n) is not None)}


def _same_weights(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (a tied lm_head may be absent on one side)."""
    return [n for n in a if n in b and not torch.equal(a[n], b[n])] + sorted(set(a) ^ set(b) - {"lm_head.weight"})


def _same_steps(own: list[dict], shared: list[dict]) -> None:
    """Every step's metrics equal, and the rollout's own ranks received (per rank) what the actor's sent."""
    for step_own, step_shared in zip(own, shared, strict=True):
        for key in COMPARED:
            assert step_own[key] == step_shared[key], key
        assert step_own["perf/sync_sent_bytes"] == step_own["perf/sync_received_bytes"] == \
            step_own["perf/sync_bytes"] > 0
        assert step_own["perf/sync_shared"] == 0.0


@pytest.mark.multiprocess
def test_rollout_on_its_own_rank_equals_the_rollout_on_the_actors_rank(tmp_path):
    own = run_distributed(_run, 2, args=(["actor.ranks=[0]", "rollout.ranks=[1]", "reward.ranks=[1]"],
                                         str(tmp_path / "own")), timeout=400)
    shared = run_distributed(_run, 2, args=(["actor.ranks=[0]", "rollout.ranks=[0]", "reward.ranks=[1]"],
                                            str(tmp_path / "shared")), timeout=400)
    assert [r["roles"] for r in own] == [["actor"], ["reward_fn", "rollout"]]
    # the rollout rank's engine holds what the actor rank trained, bit for bit (the last node synced it)
    assert _same_weights(own[0]["actor"], own[1]["rollout"]) == []
    # same samples, same updates: the weights crossed ranks bit-exactly, the batch arrived in row order
    assert _same_weights(own[0]["actor"], shared[0]["actor"]) == []
    _same_steps(own[0]["history"], shared[0]["history"])  # the actor's rank sent the whole model to the rollout's
    assert all(s["perf/sync_shared"] == 1.0 for s in shared[0]["history"])  # the rollout used the actor's module
    assert own[1]["history"][-1]["reward/mean"] == own[0]["history"][-1]["reward/mean"]


def _config(world: int, *overrides: str) -> PPOConfig:
    cfg = load_config(PPOConfig, None, [*BASE, *overrides])
    cfg.validate_world(world)
    return cfg


@pytest.mark.parametrize("overrides,match", [
    (["actor.ranks=[0, 1]", "rollout.ranks=[1, 2]"], r"rollout.ranks=\[1, 2\] partly overlaps actor.ranks=\[0, 1\]"),
    (["actor.engine=megatron", "actor.ranks=[0, 1, 2, 3]", "critic.ranks=[0, 1, 2, 3]", "rollout.ranks=[2, 3]"],
     r"rollout.ranks=\[2, 3\] differs .* megatron"),
    (["actor.engine=fsdp", "actor.fsdp.shard_size=1", "actor.ranks=[0, 1]", "rollout.ranks=[2, 3]"],
     r"actor.fsdp.shard_size=1 \(HSDP\)"),
    (["actor.ranks=[0]", "rollout.ranks=[1, 2, 3]", "data.train_batch_size=4"], r"split over the 3 rollout ranks"),
])
def test_bad_rollout_ranks_fail_before_any_step_naming_the_lists(overrides, match):
    with pytest.raises(VerlConfigError, match=match):
        _config(4, *overrides)


def test_the_example_puts_the_rollout_on_its_own_ranks_and_the_sync_on_both_sets():
    from pathlib import Path

    from verl.trainer.ppo_flow import node_configs
    cfg = load_config(PPOConfig, Path(__file__).parents[2] / "examples/rollout_own_ranks.yaml")
    cfg.validate_world(4)
    roles = cfg.roles(4)
    assert roles["rollout"].ranks == (2, 3) and roles["actor"].ranks == (0, 1) and roles["actor"].engine == "fsdp"
    nodes = node_configs(cfg, roles)
    assert nodes["generate"].device_map == nodes["reward"].device_map == (2, 3)
    assert nodes["old_log_prob"].device_map == nodes["update_actor"].device_map == (0, 1)
    assert nodes["sync_weights"].device_map == (0, 1, 2, 3)
    colocated = _config(4, "actor.ranks=[0, 1]")
    assert node_configs(colocated, colocated.roles(4))["sync_weights"].device_map == (0, 1)


@pytest.mark.multiprocess
def test_fsdp2_actor_on_two_ranks_feeds_a_rollout_on_two_others(tmp_path):
    common = ["actor.engine=fsdp", "actor.ranks=[0, 1]", "reward.ranks=[2, 3]", "data.train_batch_size=4"]
    own = run_distributed(_run, 4, args=([*common, "rollout.ranks=[2, 3]"], str(tmp_path / "own")), timeout=500)
    shared = run_distributed(_run, 4, args=([*common, "rollout.ranks=[0, 1]"], str(tmp_path / "shared")),
                             timeout=500)
    for r in (2, 3):  # each rollout rank holds the whole trained actor (generation TP 1), bit for bit
        assert _same_weights(own[0]["actor"], own[r]["rollout"]) == []
    assert _same_weights(own[0]["actor"], shared[0]["actor"]) == []
    # each actor rank sends its FSDP2 chunks to both rollout ranks, each of which receives one whole model
    _same_steps(own[0]["history"], shared[0]["history"])
