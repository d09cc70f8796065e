"""actor.fused_loss_head: the actor update through the fused RL loss head (verl.ops.linear_rl_loss called by the
engine in place of the LM head) gives the same loss, gradients (1e-5, float32) and metrics (entropy, kl, clipfrac,
ppo_kl, grad_norm) as the unfused path on a tiny model, on the torch engine and on the FSDP2 engine (2 gloo
ranks); losses and KL kinds the head cannot fuse fall back to the unfused path."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from verl.config import ActorConfig, FSDPConfig, OptimConfig
from verl.testing import run_distributed
from tests.conftest import needs_ext

pytestmark = needs_ext
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"},
        {"prompt": "2+2=", "answer": "4"}, {"prompt": "9-1=", "answer": "8"}]
KW = dict(temperature=0.9, responses_per_mini=8, max_response_length=5)


def _setup(placement, seed=3):
    from verl.data import task_corpus
    from verl.rollout import RolloutConfig, build_rollout
    from verl.models.tiny import tiny_model, tiny_tokenizer
    from verl.workers import RolloutWorker
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    model = tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                       tokenizer=tok, tie_word_embeddings=False, seed=seed, noise=0.1)
    cfg = RolloutConfig(engine="torch", n=4, max_new_tokens=5)
    rollout = RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16,
                            placement=placement)
    batch = rollout.generate(ROWS, seed=0)
    g = torch.Generator().manual_seed(1)
    mask = batch.response_mask
    adv = torch.randn(mask.shape, generator=g) * mask
    # old / ref log-probs away from the current ones, so every clip branch and the KL are exercised
    old = torch.randn(mask.shape, generator=g) * 0.3
    ref = torch.randn(mask.shape, generator=g) * 0.3
    return model, batch, adv, old, ref


def _cfg(fused: bool, **kw) -> ActorConfig:
    base = dict(micro_batch_size=4, optim=OptimConfig(lr=1e-2, grad_clip=1.0), clip_ratio_low=0.2,
                clip_ratio_high=0.28, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3",
                loss_agg_mode="seq-mean-token-mean", fused_loss_head=fused)
    base.update(kw)
    return ActorConfig(**base)


def _one_micro_batch(engine_of, model, batch, adv, old, ref, cfg):
    """(loss, stats, grads) of one micro-batch's forward + backward through the actor's loss function."""
    from verl.workers import ActorWorker
    actor = ActorWorker(engine_of(copy.deepcopy(model)), cfg, **KW)
    old_lp, _ = actor.compute_log_probs(batch)
    eng = actor.engine
    agg = eng.aggregation(cfg.loss_agg_mode, batch.response_mask, KW["max_response_length"])
    loss_fn = actor._loss_fn(agg, None)
    fields = {"response_mask": batch.response_mask, "advantages": adv, "old_log_probs": old_lp + old,
              "ref_log_probs": old_lp + ref}
    head = getattr(loss_fn, "fused_head", None)
    out = (eng._forward(batch, KW["temperature"], loss_head=functools.partial(head, fields=fields)) if head
           else eng._forward(batch, KW["temperature"]))
    loss, stats = loss_fn(out, fields)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in eng.module.named_parameters() if p.grad is not None}
    return float(loss), {k: float(v) for k, v in stats.items()}, grads, "loss" in out


def _compare(a, b, tol=1e-5):
    la, sa, ga, fused_a = a
    lb, sb, gb, fused_b = b
    assert fused_a and not fused_b
    assert abs(la - lb) <= tol * max(1.0, abs(lb))
    assert sa.keys() == sb.keys() and {"actor/entropy", "actor/kl", "actor/pg_clipfrac", "actor/kl_loss"} <= sa.keys()
    for k in sa:
        assert abs(sa[k] - sb[k]) <= tol * max(1.0, abs(sb[k])), (k, sa[k], sb[k])
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=tol, atol=tol, msg=n)


@pytest.mark.parametrize("loss,kl", [("vanilla", "k3"), ("gspo", "k1"), ("reinforce", "k3+")])
def test_torch_engine_fused_head_matches_unfused(loss, kl):
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    placement = init_placement("cpu")
    model, batch, adv, old, ref = _setup(placement)
    engine_of = lambda m: TorchEngine(m, OptimConfig(lr=1e-2), placement, total_steps=3)  # noqa: E731
    fused = _one_micro_batch(engine_of, model, batch, adv, old, ref, _cfg(True, policy_loss=loss, kl_loss_type=kl))
    plain = _one_micro_batch(engine_of, model, batch, adv, old, ref, _cfg(False, policy_loss=loss, kl_loss_type=kl))
    _compare(fused, plain)
    assert fused[1]["actor/pg_clipfrac"] > 0 or loss == "reinforce"  # the clip branches are exercised


def test_actor_update_metrics_match_and_unfusable_configs_fall_back():
    """A whole update (2 epochs, micro-batches, optimizer steps; on-policy and with rollout-correction weights)."""
    from verl.distributed import init_placement
    from verl.workers import ActorWorker, TorchEngine
    placement = init_placement("cpu")
    model, batch, adv, _, ref = _setup(placement)
    out = {}
    for fused in (True, False):
        cfg = _cfg(fused, ppo_epochs=2)
        actor = ActorWorker(TorchEngine(copy.deepcopy(model), cfg.optim, placement, total_steps=3), cfg, **KW)
        lp, _ = actor.compute_log_probs(batch)
        out[fused] = (actor.update(batch, None, adv, lp + ref), actor.engine.module.lm_head.weight.detach().clone())
    (a, wa), (b, wb) = out[True], out[False]
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
    torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)
    # cispo and a registered Python KL have no fused head: the same loss function takes the unfused path
    actor = ActorWorker(TorchEngine(copy.deepcopy(model), OptimConfig(), placement), _cfg(True, policy_loss="cispo"),
                        **KW)
    assert actor._head_kinds() is None
    assert ActorWorker(TorchEngine(copy.deepcopy(model), OptimConfig(), placement), _cfg(True), **KW)._head_kinds() \
        == ("vanilla", "low_var_kl")


def _fsdp_body(rank, world):
    from verl.distributed import init_placement
    from verl.workers.fsdp import FSDPEngine
    placement = init_placement("cpu")
    model, batch, adv, old, ref = _setup(placement)
    engine_of = lambda m: FSDPEngine(m, OptimConfig(lr=1e-2), placement, FSDPConfig(), total_steps=3)  # noqa: E731
    fused = _one_micro_batch(engine_of, model, batch, adv, old, ref, _cfg(True))
    plain = _one_micro_batch(engine_of, model, batch, adv, old, ref, _cfg(False))
    _compare(fused, plain)
    return True


def test_fsdp_engine_fused_head_matches_unfused_on_two_ranks():
    assert run_distributed(_fsdp_body, world_size=2, timeout=240) == [True, True]


def _megatron_case(path, placement, batch, adv, ref, mcfg, inline_is: bool = False) -> dict:
    """Update stats of the fused and the unfused actor on fresh megatron engines. `inline_is`: on-policy (no old
    log-probs) with token-level truncated IS against rollout log-probs moved away from the policy's, so the
    weights come from the update's own forward (the fused head's no-grad pass of this rank's vocabulary shard)."""
    import dataclasses

    from verl.config.ppo import RolloutCorrectionConfig
    from verl.workers import ActorWorker
    from verl.workers.megatron import MegatronEngine
    out = {}
    for fused in (True, False):
        cfg = _cfg(fused, micro_batch_size=4)
        corr = RolloutCorrectionConfig(is_level="token", is_cap=1.3) if inline_is else None
        actor = ActorWorker(MegatronEngine(path, placement, mcfg, optim=cfg.optim, total_steps=3), cfg,
                            rollout_correction=corr, **KW)
        lp, _ = actor.compute_log_probs(batch)
        if inline_is:
            mu = (lp - 2.0 * ref) * batch.response_mask
            out[fused] = actor.update(dataclasses.replace(batch, rollout_log_probs=mu), None, adv, lp + ref)
            assert 0 < out[fused]["rollout_corr/is_truncated_frac"] < 1
        else:
            out[fused] = actor.update(batch, lp + 0.2 * ref, adv, lp + ref)
        assert type(actor.engine.model.gpt.output_layer).__name__ != "_HiddenOutput"  # restored
    return out


def _megatron_problem(tmp_dir, save: bool):
    from verl.config import TinyModelConfig
    from verl.data import task_corpus
    from verl.rollout import RolloutConfig, build_rollout
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    from verl.workers import RolloutWorker
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model = tiny_model(shape, tokenizer=tok, tie_word_embeddings=True, seed=3)
    if save:
        save_tiny(model, tok, tmp_dir)
    cfg_r = RolloutConfig(engine="hf", n=4, max_new_tokens=5)
    batch = RolloutWorker(build_rollout(cfg_r, model=model, tokenizer=tok), cfg_r,
                          max_prompt_length=16).generate(ROWS[:2], seed=0)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    ref = torch.randn(batch.response_mask.shape, generator=g) * 0.3
    return batch, adv, ref


def _assert_same_stats(a, b, tol=1e-4):
    assert a.keys() == b.keys() and "actor/kl_loss" in a
    for k in a:
        assert abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k])), (k, a[k], b[k])


def test_megatron_engine_fused_head_matches_unfused(tmp_path, monkeypatch):
    """TP=1 megatron (gloo, one process; the vocabulary is padded 96 -> 128 rows, which the head leaves out): the
    output layer hands back hidden states to the vocab-parallel head."""
    import torch.distributed as dist

    import verl.ops.rl_head as rl_head
    from verl.config import MegatronConfig
    from verl.distributed import destroy_process_groups, init_placement
    calls = []
    real = rl_head.vocab_parallel_linear_rl_loss
    monkeypatch.setattr(rl_head, "vocab_parallel_linear_rl_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    placement = init_placement("cpu", megatron=True)
    try:
        batch, adv, ref = _megatron_problem(tmp_path / "hf", save=True)
        out = _megatron_case(tmp_path / "hf", placement, batch, adv, ref, MegatronConfig())
        assert len(calls) == 2  # the fused run's two micro-batches went through the vocab-parallel head
        _assert_same_stats(out[True], out[False])
    finally:
        destroy_process_groups()
        dist.destroy_process_group()


def _megatron_tp2_body(rank, world, path):
    from verl.config import MegatronConfig
    from verl.distributed import init_placement
    placement = init_placement("cpu", tp=2, megatron=True)
    batch, adv, ref = _megatron_problem(path, save=False)
    return (_megatron_case(path, placement, batch, adv, ref, MegatronConfig(tp=2)),
            _megatron_case(path, placement, batch, adv, ref, MegatronConfig(tp=2), inline_is=True))


def test_megatron_tp2_fused_head_matches_unfused(tmp_path):
    """TP=2 on 2 gloo ranks: each rank's vocabulary shard, the all-reduced softmax statistics, and d loss / d
    hidden summed over TP by the output layer's own region (copy_to_tensor_model_parallel_region's backward);
    and on-policy IS weights from the head's own pass over the shards (the last rank's shard is short: 96 real
    of 128 padded rows) equal the unfused path's."""
    _megatron_problem(tmp_path / "hf", save=True)
    for plain, inline in run_distributed(_megatron_tp2_body, world_size=2, args=(str(tmp_path / "hf"),),
                                         timeout=300):
        _assert_same_stats(plain[True], plain[False])
        _assert_same_stats(inline[True], inline[False])
