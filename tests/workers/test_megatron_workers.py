"""The megatron engine: same log-probs as the torch engine on the same weights and batch, a PPO update
that changes the weights, weight sync to the rollout model, and resume equality through main_ppo."""

from __future__ import annotations

import json

import pytest
import torch

from verl.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig, TinyModelConfig
from verl.data import task_corpus
from verl.rollout import RolloutConfig, build_rollout
from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
from verl.workers import ActorWorker, CriticWorker, RolloutWorker, TorchEngine

from tests.trainer.conftest import TINY

SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"}]


@pytest.fixture
def megatron_setup(tmp_path_factory):
    import torch.distributed as dist

    from verl.distributed import destroy_process_groups, init_placement
    placement = init_placement("cpu", megatron=True)
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=3)
    path = save_tiny(model, tok, tmp_path_factory.mktemp("hf"))
    yield placement, tok, model, path
    destroy_process_groups()
    dist.destroy_process_group()


def _rollout(model, tok):
    cfg = RolloutConfig(engine="hf", n=4, max_new_tokens=5)
    return RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16)


def test_megatron_actor_matches_torch_and_syncs_weights(megatron_setup):
    from verl.workers.megatron import MegatronEngine
    placement, tok, model, path = megatron_setup
    batch = _rollout(model, tok).generate(ROWS, seed=0)
    cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2))
    kw = dict(temperature=1.0, responses_per_mini=8, max_response_length=5)
    ref = ActorWorker(TorchEngine(model, None, placement), cfg, **kw)
    meg = ActorWorker(MegatronEngine(path, placement, MegatronConfig(), optim=cfg.optim, total_steps=10), cfg, **kw)
    lp_t, ent_t = ref.compute_log_probs(batch)
    lp_m, ent_m = meg.compute_log_probs(batch)
    torch.testing.assert_close(lp_m, lp_t, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent_m, ent_t, rtol=1e-4, atol=1e-4)
    adv = torch.randn(len(batch))[:, None] * batch.response_mask
    stats = meg.update(batch, None, adv, None)
    assert stats["actor/grad_norm"] > 0
    # the rollout/train mismatch of the on-policy update: HF generate against megatron's forward
    assert 0 <= stats["rollout/mismatch_mean"] <= stats["rollout/mismatch_max"] < 1e-3
    rollout_model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=99)  # different weights until synced
    rollout = _rollout(rollout_model, tok)
    sync = rollout.sync_weights(meg)
    assert sync["perf/sync_shared"] == 0.0 and sync["perf/sync_s"] > 0
    after = ActorWorker(TorchEngine(rollout_model, None, placement), cfg, **kw).compute_log_probs(batch)[0]
    torch.testing.assert_close(after, meg.compute_log_probs(batch)[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, lp_t)
    critic = CriticWorker(MegatronEngine(path, placement, MegatronConfig(), value_head=True,
                                         optim=OptimConfig(lr=1e-2), total_steps=10), CriticConfig(micro_batch_size=4))
    values = critic.compute_values(batch)
    assert values.shape == batch.response_mask.shape
    assert critic.update(batch, values, torch.ones_like(values) * batch.response_mask)["critic/grad_norm"] > 0


def _length_reward(response, gt, prompt):
    return float(len(response))


def test_megatron_ppo_resume_equals_uninterrupted(tmp_path):
    from verl.trainer.main_ppo import main
    from verl.rewards import register_reward
    register_reward("test_length_megatron")(_length_reward)
    args = [*TINY, "actor.engine=megatron", "reward.name=test_length_megatron", "algorithm.adv_estimator=gae",
            "actor.use_kl_loss=true", "actor.optim.lr=1e-2", "trainer.export_hf=false", "trainer.plot=false"]
    main([*args, "trainer.total_steps=3", f"trainer.output_dir={tmp_path / 'full'}"])
    main([*args, "trainer.total_steps=2", f"trainer.output_dir={tmp_path / 'part'}"])
    main([*args, "trainer.total_steps=3", "trainer.resume=auto", f"trainer.output_dir={tmp_path / 'part'}"])

    def steps(d):
        recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("perf/", "timing/", "resumed_from_step"))}
                for r in recs if "reward/mean" in r}
    full, part = steps(tmp_path / "full"), steps(tmp_path / "part")
    assert sorted(part) == [1, 2, 3] and part == full
    ckpt = tmp_path / "part" / "checkpoints" / "step_000003"
    assert (ckpt / ".metadata").is_file() and not any(p.is_dir() for p in ckpt.iterdir())  # all of it in DCP
    assert "critic/vf_loss" in full[3] and "actor/kl_loss" in full[3]


def _tp2_fit(overrides):
    from verl.config import PPOConfig, load_config
    from verl.distributed import destroy_process_groups
    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.distributed import init_placement
    cfg = load_config(PPOConfig, None, overrides)
    trainer = PPOTrainer(cfg, init_placement("cpu", tp=cfg.actor.megatron.tp, megatron=True))
    history = trainer.fit()
    rollout_params = torch.cat([p.detach().reshape(-1) for p in trainer.policy.parameters()])
    p = trainer.placement
    out = {"dp": (p.dp_rank, p.dp_size), "rollout": rollout_params, "last": history[-1], "reward": history[-1]["reward/mean"],
           "grad_norm": history[-1]["actor/grad_norm"]}
    destroy_process_groups()
    return out


def _tp2_run(rank, world_size, overrides, root):
    full = _tp2_fit([*overrides, "trainer.total_steps=3", "trainer.save_final=false", "rollout.compare_full_gather=true",
                     f"trainer.output_dir={root}/full"])
    _tp2_fit([*overrides, "trainer.total_steps=2", f"trainer.output_dir={root}/part"])
    resumed = _tp2_fit([*overrides, "trainer.total_steps=3", "trainer.resume=auto", "trainer.save_final=false",
                        f"trainer.output_dir={root}/part"])
    return {**full, "resumed": resumed["rollout"]}


@pytest.mark.multiprocess
def test_megatron_tensor_parallel_two_ranks(tmp_path):
    """TP=2 over two gloo ranks: one data-parallel replica, identical rollout weights after the HF sync, and a
    resume from the DCP checkpoint (each rank's TP shard under its own key) equal to the uninterrupted run."""
    from verl.testing import run_distributed
    args = [*TINY, "actor.engine=megatron", "actor.megatron.tp=2", "reward.name=tests.trainer.test_multiprocess:length_reward",
            "actor.optim.lr=1e-2", "trainer.export_hf=false", "trainer.plot=false"]
    r0, r1 = run_distributed(_tp2_run, 2, args=(args, str(tmp_path)), timeout=600)
    assert r0["dp"] == r1["dp"] == (0, 1)
    assert torch.equal(r0["rollout"], r1["rollout"]) and r0["reward"] == r1["reward"]
    assert r0["grad_norm"] > 0
    # TP=2 trained, TP=1 generated: each rank gathers its peer's half lazily; the old full gather, timed in the
    # same run, moved the whole model to every rank
    m = r0["last"]
    assert m["perf/sync_shared"] == 0 and 0 < m["perf/sync_comm_bytes"] < m["perf/sync_bytes"]
    assert m["perf/full_gather_bytes"] == m["perf/sync_bytes"] and m["perf/full_gather_s"] > 0
    assert torch.equal(r0["resumed"], r0["rollout"]) and torch.equal(r1["resumed"], r1["rollout"])
