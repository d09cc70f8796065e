"""Split placement on 4 gloo ranks: the actor and its rollout on ranks 0-1, the critic and the reward on ranks
2-3. The batch crosses rank sets through the dataflow's redistribution, and the run computes exactly what the
same job computes colocated on 2 ranks (every role on both)."""

from __future__ import annotations

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.distributed import init_placement
from verl.testing import run_distributed
from verl.trainer.ppo_trainer import PPOTrainer

from tests.trainer.conftest import TINY

BASE = [*TINY, "reward.name=tests.trainer.test_multiprocess:length_reward", "trainer.export_hf=false",
        "trainer.plot=false", "actor.optim.lr=1e-2", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
        "warmup.steps=0", "trainer.total_steps=2", "trainer.save_final=false"]


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _run(rank, world_size, overrides, out):
    trainer = PPOTrainer(load_config(PPOConfig, None, [*BASE, *overrides, f"trainer.output_dir={out}"]),
                         init_placement("cpu"))
    history = trainer.fit()
    return {"actor": None if trainer.actor is None else _flat(trainer.actor.engine.module),
            "critic": None if trainer.critic is None else _flat(trainer.critic.engine.module),
            "roles": sorted(n for n in ("actor", "ref", "critic", "rollout", "reward_fn")
                            if getattr(trainer, n) is not None),
            "history": history}


@pytest.mark.multiprocess
def test_split_placement_equals_colocated(tmp_path):
    split = run_distributed(_run, 4, args=(["trainer.placement=split"], str(tmp_path / "split")), timeout=400)
    colo = run_distributed(_run, 2, args=([], str(tmp_path / "colo")), timeout=300)
    assert [r["roles"] for r in split] == [["actor", "ref", "rollout"]] * 2 + [["critic", "reward_fn"]] * 2
    # the actor's ranks trained what the colocated actors trained, the critic's ranks what their critics did
    for r in (0, 1):
        torch.testing.assert_close(split[r]["actor"], colo[r]["actor"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(split[2 + r]["critic"], colo[r]["critic"], rtol=1e-5, atol=1e-6)
    for step_split, step_colo in zip(split[0]["history"], colo[0]["history"]):
        for key in ("reward/mean", "critic/vf_loss", "actor/pg_loss", "advantage/mean"):
            assert step_split[key] == pytest.approx(step_colo[key], rel=1e-5, abs=1e-6), key
        assert step_split["timing/transfer_s"] > 0  # the batch, scores and values crossed rank sets
    # every rank logs the same reduced metrics (the critic's ranks included)
    for r in split[1:]:
        assert r["history"][-1]["critic/vf_loss"] == split[0]["history"][-1]["critic/vf_loss"]
        assert r["history"][-1]["reward/mean"] == split[0]["history"][-1]["reward/mean"]
