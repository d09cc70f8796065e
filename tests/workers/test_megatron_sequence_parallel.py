"""The megatron engine on two gloo ranks with TP=2: sequence parallelism on a batch of odd length (megatron splits
the sequence into TP equal parts, so the engine pads each micro-batch) gives what TP=2 without it gives, and the
non-finite guard skips a step on both TP ranks when one of them produces a NaN, then fails the run naming it.
Both topics share one spawn (megatron's start-up dominates these tests)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig, TinyModelConfig
from verl.testing import run_distributed

from tests.reliability.test_nonfinite_guard import P, R, synthetic_batch

SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
assert (P + R) % 2 == 1  # the point: a length TP=2 does not divide


def _shard(engine) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.model.gpt.parameters()])


def _layout_case(placement, path, sp: bool, batch, adv) -> dict:
    """Log-probs, a PPO update, and a critic's values and update on one layout."""
    from verl.workers import ActorWorker, CriticWorker
    from verl.workers.megatron import MegatronEngine
    mcfg = MegatronConfig(tp=2, sequence_parallel=sp)
    optim = OptimConfig(lr=1e-2)
    actor = ActorWorker(MegatronEngine(path, placement, mcfg, optim=optim, total_steps=10),
                        ActorConfig(micro_batch_size=4), temperature=1.0, responses_per_mini=8, max_response_length=R)
    lp, ent = actor.compute_log_probs(batch)
    stats = actor.update(batch, None, adv, None)
    torch.manual_seed(0)  # the value head is not in the checkpoint: the same random one on both layouts
    critic = CriticWorker(MegatronEngine(path, placement, mcfg, value_head=True, optim=optim, total_steps=10),
                          CriticConfig(micro_batch_size=4))
    values = critic.compute_values(batch)
    cstats = critic.update(batch, values, torch.ones_like(values) * batch.response_mask)
    return {"lp": lp, "ent": ent, "pg_loss": stats["actor/pg_loss"], "grad_norm": stats["actor/grad_norm"],
            "after": actor.compute_log_probs(batch)[0], "shard": _shard(actor.engine), "values": values,
            "critic_norm": cstats["critic/grad_norm"], "critic_shard": _shard(critic.engine), "actor": actor}


def _guard_case(actor, batch, adv, rank: int) -> dict:
    """Rank 1 alone poisons one gradient (a hook on one of its TP shards); after a clean step, its loss, until the
    guard fails."""
    from verl.errors import VerlRuntimeError
    out = {"start": _shard(actor.engine)}
    param = next(p for n, p in actor.engine.model.gpt.named_parameters() if "linear_fc1" in n)
    hook = param.register_hook(lambda g: g * float("nan")) if rank == 1 else None
    out["nan_grad"] = actor.update(batch, None, adv, None, step=0)
    out["first_nan_grad"] = actor.guard.first
    if hook is not None:
        hook.remove()
    out["after_nan_grad"] = _shard(actor.engine)
    actor.update(batch, None, adv, None, step=1)
    out["before_failing"] = _shard(actor.engine)
    nan_adv = adv.clone()
    nan_adv[1, 0] = float("nan")
    try:
        for step in range(2, 8):
            actor.update(batch, None, nan_adv if rank == 1 else adv, None, step=step)
        out["error"] = None
    except VerlRuntimeError as e:
        out["error"], out["failed_at"] = str(e), step
    out["end"] = _shard(actor.engine)
    return out


def _body(rank, world_size, path):
    from verl.distributed import destroy_process_groups, init_process_groups
    sp = init_process_groups(tp=2, sequence_parallel=True)
    tp_only = dataclasses.replace(sp, sequence_parallel=False)
    batch = synthetic_batch(96, seed=0)  # TP peers hold the same batch
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))[:, None] * batch.response_mask
    results = {"tp": _layout_case(tp_only, path, False, batch, adv), "sp": _layout_case(sp, path, True, batch, adv)}
    results["guard"] = _guard_case(results["sp"].pop("actor"), batch, adv, rank)
    results["tp"].pop("actor")
    destroy_process_groups()
    return results


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    from verl.models.tiny import save_tiny, tiny_model
    path = save_tiny(tiny_model(SHAPE, seed=3, noise=0.1), None, tmp_path_factory.mktemp("hf"))
    return run_distributed(_body, 2, args=(str(path),), timeout=600)


@pytest.mark.multiprocess
def test_sequence_parallel_on_an_odd_length_matches_tensor_parallel(tp2_results):
    for res in tp2_results:
        tp, sp = res["tp"], res["sp"]
        for key in ("lp", "ent", "after", "values"):
            torch.testing.assert_close(sp[key], tp[key], rtol=1e-4, atol=1e-5, msg=key)
        for key in ("shard", "critic_shard"):  # Adam's first step ~ lr * g / |g| magnifies rounding in small g
            torch.testing.assert_close(sp[key], tp[key], rtol=0, atol=1e-3, msg=key)
        for key in ("pg_loss", "grad_norm", "critic_norm"):
            assert sp[key] == pytest.approx(tp[key], rel=1e-4, abs=1e-6), key
        assert tp["grad_norm"] > 0 and not torch.equal(tp["after"], tp["lp"])  # the update did something


@pytest.mark.multiprocess
def test_megatron_guard_agrees_over_the_tensor_parallel_ranks(tp2_results):
    g0, g1 = (r["guard"] for r in tp2_results)
    for g in (g0, g1):
        assert g["nan_grad"]["actor/nonfinite_steps"] == 1.0 and torch.equal(g["after_nan_grad"], g["start"])
        # rank 0's own gradients were finite; the norm over the TP group was not, and rank 1 names the shard
        assert "the gradient of 'decoder.layers." in g["first_nan_grad"] and "linear_fc1" in g["first_nan_grad"]
        assert g["first_nan_grad"].startswith("optimizer step 2 (training step 1): ")
        assert g["first_nan_grad"].endswith("on rank 1")
        assert g["failed_at"] == 4 and torch.equal(g["end"], g["before_failing"]) and torch.isfinite(g["end"]).all()
    assert g0["error"] == g1["error"]
    assert "actor: 3 optimizer steps in a row" in g0["error"]
    # the layout case's update was this actor's optimizer step 1
    assert "the first at optimizer step 4 (training step 3): the loss of micro-batch 0 is nan on rank 1" in g0["error"]
