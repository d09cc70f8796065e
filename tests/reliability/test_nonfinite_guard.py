"""The non-finite guard: a NaN loss or gradient skips the optimizer step on every rank of the engine (weights,
optimizer state and schedule untouched, the replicas still identical), counts in actor/critic nonfinite_steps,
and trainer.max_nonfinite_steps skipped steps in a row fail the run with a VerlRuntimeError that names the step,
the rank and the first non-finite quantity. NaN is injected into the loss (NaN advantages / returns on one rank)
or into one parameter's gradient (a hook on one rank), never into the weights themselves.

Megatron (TP=2, whose ranks agree over the model-parallel group) is checked in
tests/workers/test_megatron_sequence_parallel.py, which spawns its ranks once for both topics."""

from __future__ import annotations

import json
import math

import pytest
import torch

from verl.config import ActorConfig, CriticConfig, OptimConfig, TinyModelConfig
from verl.distributed import Placement
from verl.errors import VerlRuntimeError
from verl.testing import run_distributed
from verl.workers.batch import RolloutBatch

from tests.trainer.conftest import TINY

SHAPE = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
P, R = 4, 3
HOOKED = "model.layers.0.mlp.up_proj.weight"


def synthetic_batch(vocab: int, seed: int, rows: int = 8) -> RolloutBatch:
    """`rows` responses of R tokens after P-token prompts (every other prompt left-padded by one)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, P + R), generator=g)
    attn = torch.ones(rows, P + R, dtype=torch.long)
    attn[::2, 0] = 0
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=attn[:, P:].float(), group=torch.arange(rows) // 2)


def params(module) -> torch.Tensor:
    """Every weight, whole (collective for FSDP's DTensors), as one flat vector."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).clone()
                      for p in module.parameters()])


def _engine(kind: str, module, optim, placement, head="lm"):
    from verl.workers import TorchEngine
    if kind == "torch":
        return TorchEngine(module, optim, placement, head=head, total_steps=10)
    from verl.config import FSDPConfig
    from verl.workers.fsdp import FSDPEngine
    return FSDPEngine(module, optim, placement, FSDPConfig(), head=head, total_steps=10)


def actor_scenario(placement: Placement, kind: str, poison: int) -> dict:
    """Actor updates poisoned on rank `poison` (a NaN loss; on the torch engine also a NaN gradient), each
    followed by a clean one, then NaN losses until the guard fails the run. Returns what each phase left behind
    on this rank."""
    from verl.models.tiny import tiny_model
    from verl.workers import ActorWorker
    model = tiny_model(SHAPE, seed=3, noise=0.1)
    worker = ActorWorker(_engine(kind, model, OptimConfig(lr=1e-2), placement), ActorConfig(micro_batch_size=4),
                         temperature=1.0, responses_per_mini=8, max_response_length=R, max_nonfinite_steps=3)
    me = placement.global_rank
    batch = synthetic_batch(model.config.vocab_size, seed=me)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(me))[:, None] * batch.response_mask
    nan_adv = adv.clone()
    nan_adv[1, 0] = float("nan")
    out = {"start": params(worker.engine.module)}
    out["nan_loss"] = worker.update(batch, None, nan_adv if me == poison else adv, None, step=0)
    out["after_nan_loss"], out["first_nan_loss"] = params(worker.engine.module), worker.guard.first
    out["grads_left"] = [n for n, p in worker.engine.module.named_parameters() if p.grad is not None]
    out["clean"] = worker.update(batch, None, adv, None, step=1)
    out["after_clean"], out["streak_after_clean"] = params(worker.engine.module), worker.guard.streak
    if kind == "torch":  # FSDP2 reduces in backward: which rank produced a NaN gradient cannot be told there
        param = dict(worker.engine.module.named_parameters())[HOOKED]
        hook = param.register_hook(lambda g: g * float("nan")) if me == poison else None
        out["nan_grad"] = worker.update(batch, None, adv, None, step=2)
        out["first_nan_grad"] = worker.guard.first
        if hook is not None:
            hook.remove()
        out["after_nan_grad"] = params(worker.engine.module)
        worker.update(batch, None, adv, None, step=3)
    out["before_failing"] = params(worker.engine.module)
    try:
        for step in range(10, 20):
            worker.update(batch, None, nan_adv if me == poison else adv, None, step=step)
        out["error"] = None
    except VerlRuntimeError as e:
        out["error"], out["failed_at"] = str(e), step
    out["end"] = params(worker.engine.module)
    return out


def check_actor_scenario(res: dict, kind: str, poison: int) -> None:
    assert res["nan_loss"]["actor/nonfinite_steps"] == 1.0
    assert "actor/pg_loss" not in res["nan_loss"]  # the skipped step's NaN statistics stay out of the metrics
    assert torch.equal(res["after_nan_loss"], res["start"]) and res["grads_left"] == []
    assert res["first_nan_loss"] == \
        f"optimizer step 1 (training step 1): the loss of micro-batch 0 is nan on rank {poison}"
    assert res["clean"]["actor/nonfinite_steps"] == 0.0 and math.isfinite(res["clean"]["actor/grad_norm"])
    assert not torch.equal(res["after_clean"], res["start"]) and res["streak_after_clean"] == 0
    assert torch.isfinite(res["after_clean"]).all()
    if kind == "torch":
        assert res["nan_grad"]["actor/nonfinite_steps"] == 1.0
        assert torch.equal(res["after_nan_grad"], res["after_clean"])
        assert res["first_nan_grad"].startswith(f"optimizer step 3 (training step 3): the gradient of '{HOOKED}' has ")
        assert res["first_nan_grad"].endswith(f"on rank {poison}")
    # the third NaN step in a row fails the run, and no NaN reached the weights on the way
    assert res["failed_at"] == 12 and torch.equal(res["end"], res["before_failing"])
    msg = res["error"]
    assert "actor: 3 optimizer steps in a row" in msg and "trainer.max_nonfinite_steps=3" in msg
    first = 5 if kind == "torch" else 3  # the torch scenario took two more optimizer steps
    assert f"the first at optimizer step {first} (training step 11): the loss of micro-batch 0 is nan on rank " \
           f"{poison}" in msg


def test_behaves_nan_loss_and_gradient_skip_the_step_in_process():
    check_actor_scenario(actor_scenario(Placement(), "torch", poison=0), "torch", poison=0)


def test_behaves_critic_nan_returns_skip_the_step():
    from verl.models.tiny import tiny_model
    from verl.workers import CriticWorker, TorchEngine, ValueModel
    value_model = ValueModel.from_causal_lm(tiny_model(SHAPE, seed=3))
    critic = CriticWorker(TorchEngine(value_model, OptimConfig(lr=1e-2), Placement(), head="value"),
                          CriticConfig(micro_batch_size=4), max_nonfinite_steps=2)
    batch = synthetic_batch(value_model.trunk.config.vocab_size, seed=0)
    values = critic.compute_values(batch)
    returns = torch.ones_like(values) * batch.response_mask
    start = params(value_model)
    bad = returns.clone()
    bad[0, 0] = float("inf")
    stats = critic.update(batch, values, bad, step=0)
    assert stats["critic/nonfinite_steps"] == 1.0 and "critic/vf_loss" not in stats
    assert torch.equal(params(value_model), start)
    assert critic.update(batch, values, returns, step=1)["critic/nonfinite_steps"] == 0.0
    moved = params(value_model)
    assert not torch.equal(moved, start)
    critic.update(batch, values, bad, step=2)
    with pytest.raises(VerlRuntimeError, match=r"critic: 2 optimizer steps in a row .* the first at optimizer step "
                                               r"3 \(training step 3\): the loss of micro-batch 0 is (nan|inf) on "
                                               r"rank 0"):
        critic.update(batch, values, bad, step=3)
    assert torch.equal(params(value_model), moved)


def _two_ranks(rank, world_size):
    from verl.distributed import init_placement
    placement = init_placement("cpu")
    return {kind: actor_scenario(placement, kind, poison=1) for kind in ("torch", "fsdp")}


@pytest.mark.multiprocess
def test_behaves_nan_on_one_rank_skips_the_step_on_both():
    """Rank 1's NaN (loss, or one gradient before the averaging) skips the step on rank 0 too: both keep their
    weights, stay identical, count the step, and fail together naming rank 1."""
    r0, r1 = run_distributed(_two_ranks, 2, timeout=300)
    for kind in ("torch", "fsdp"):
        for res in (r0[kind], r1[kind]):
            check_actor_scenario(res, kind, poison=1)
        for key in ("after_nan_loss", "after_clean", "end"):
            assert torch.equal(r0[kind][key], r1[kind][key]), (kind, key)
        assert r0[kind]["error"] == r1[kind]["error"]
    # the averaging spread rank 1's NaN gradient to rank 0; the guard still names rank 1 (check_actor_scenario)
    assert torch.equal(r0["torch"]["after_nan_grad"], r1["torch"]["after_nan_grad"])


def test_clear_trainer_fails_after_max_nonfinite_steps(tmp_path, monkeypatch):
    """A whole run whose policy loss is NaN: steps are skipped and logged, then the run fails naming them."""
    import verl.workers.actor as actor_module
    from verl.trainer.main_ppo import main
    real = actor_module.actor_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats
    monkeypatch.setattr(actor_module, "actor_loss", nan_loss)
    out = tmp_path / "run"
    with pytest.raises(VerlRuntimeError) as info:
        # the NaN is injected into the unfused loss (verl.algos.actor_loss), so the fused loss head is off here
        main([*TINY, "actor.fused_loss_head=false", "trainer.total_steps=4", "trainer.max_nonfinite_steps=2",
              "trainer.export_hf=false",
              "trainer.plot=false", f"trainer.output_dir={out}"])
    msg = str(info.value)
    assert "update_actor" in msg and "actor: 2 optimizer steps in a row" in msg
    assert "the first at optimizer step 1 (training step 1): the loss of micro-batch 0 is nan on rank 0" in msg
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["actor/nonfinite_steps"] == 1.0
