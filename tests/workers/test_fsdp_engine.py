"""The FSDP2 engine on two gloo ranks: the same log-probs as the torch engine on the same weights, the same
optimizer step as the torch engine's data-parallel step (global-norm clipping included, 1-D and HSDP meshes,
with and without CPU offload), a bit-exact weight sync into a torch rollout engine from the dim-0 shards, a
bad shard_size named before any step, and `verl train` with actor.engine=fsdp (GAE critic) resuming exactly."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from verl.config import ActorConfig, CriticConfig, FSDPConfig, OptimConfig, PPOConfig, load_config
from verl.errors import VerlConfigError
from verl.testing import run_distributed

from tests.trainer.conftest import TINY

ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"},
        {"prompt": "2+2=", "answer": "4"}, {"prompt": "9-1=", "answer": "8"}]
KW = dict(temperature=1.0, responses_per_mini=8, max_response_length=5)


def _setup(seed: int = 3):
    from verl.data import task_corpus
    from verl.models.tiny import tiny_model, tiny_tokenizer
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    model = tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                       tokenizer=tok, tie_word_embeddings=True, seed=seed, noise=0.1)
    return tok, model


def _rollout(model, tok, placement):
    from verl.rollout import RolloutConfig, build_rollout
    from verl.workers import RolloutWorker
    cfg = RolloutConfig(engine="torch", n=4, max_new_tokens=5)
    return RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16,
                         placement=placement)


def _full(module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective for DTensors)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def _step_case(placement, tok, model, batch, adv, fsdp_cfg: FSDPConfig, grad_clip: float,
               cpu_offload: bool = False) -> dict:
    """One PPO actor update and one critic update on the torch engine and on the FSDP engine; their results."""
    from verl.workers import ActorWorker, CriticWorker, TorchEngine, ValueModel
    from verl.workers.fsdp import FSDPEngine
    optim = OptimConfig(lr=1e-2, grad_clip=grad_clip)
    cfg = ActorConfig(micro_batch_size=4, optim=optim)
    out = {}
    for name, engine_of in (("torch", lambda m, h: TorchEngine(m, optim, placement, head=h, total_steps=5)),
                            ("fsdp", lambda m, h: FSDPEngine(m, optim, placement, fsdp_cfg, head=h, total_steps=5,
                                                              cpu_offload=cpu_offload))):
        actor = ActorWorker(engine_of(copy.deepcopy(model), "lm"), cfg, **KW)
        lp, ent = actor.compute_log_probs(batch)
        stats = actor.update(batch, lp, adv, None)
        value_model = ValueModel.from_causal_lm(model)
        value_model.value_head.weight.data.fill_(0.05)  # values that depend on the trunk
        critic = CriticWorker(engine_of(value_model, "value"), CriticConfig(micro_batch_size=4))
        values = critic.compute_values(batch)
        cstats = critic.update(batch, values, torch.ones_like(values) * batch.response_mask)
        out[name] = {"lp": lp, "ent": ent, "grad_norm": stats["actor/grad_norm"], "params": _full(actor.engine.module),
                     "values": values, "critic_norm": cstats["critic/grad_norm"],
                     "critic_params": _full(critic.engine.module), "engine": actor}
    return out


def _engine_body(rank, world):
    from verl.distributed import init_placement
    from verl.workers.fsdp import FSDPEngine
    placement = init_placement("cpu")
    tok, model = _setup()
    batch = _rollout(model, tok, placement).generate(ROWS, seed=rank)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(rank))[:, None] * batch.response_mask
    results = {}
    for case, fsdp_cfg, clip in (("plain", FSDPConfig(), 0.0), ("clipped", FSDPConfig(), 1e-3),
                                 ("hsdp", FSDPConfig(shard_size=1), 1e-3),
                                 ("offload", FSDPConfig(reshard_after_forward=False), 1e-3)):
        out = _step_case(placement, tok, model, batch, adv, fsdp_cfg, clip, cpu_offload=case == "offload")
        t, f = out["torch"], out["fsdp"]
        res = {k: (t[k], f[k]) for k in ("lp", "ent", "grad_norm", "values", "critic_norm")}
        res["params"] = max(float((t["params"][n] - f["params"][n]).abs().max()) for n in t["params"])
        res["critic_params"] = max(float((t["critic_params"][n] - f["critic_params"][n]).abs().max())
                                   for n in t["critic_params"])
        res["moved"] = max(float((t["params"][n] - p.detach()).abs().max()) for n, p in model.named_parameters())
        res["sharded"] = {str(p.placements) for p in f["engine"].engine.module.parameters()}
        res["offloaded"] = {p.to_local().device.type for p in f["engine"].engine.module.parameters()}
        if case in ("clipped", "hsdp"):
            results[f"sync_{case}"] = _sync_case(placement, tok, f["engine"], batch)
        results[case] = res
    bf16 = FSDPEngine(copy.deepcopy(model), None, placement, FSDPConfig(param_dtype="bfloat16"))
    results["bf16"] = {"lp": (results["plain"]["lp"][0], bf16.forward(batch, 4)["log_probs"]),
                       "dtypes": {str(p.dtype) for p in bf16.module.parameters()}}
    try:
        FSDPEngine(copy.deepcopy(model), None, placement, FSDPConfig(shard_size=3))
    except VerlConfigError as e:
        results["bad_shard_size"] = str(e)
    return results


def _sync_case(placement, tok, actor, batch) -> dict:
    """The FSDP actor's weights into a torch rollout engine holding other weights: bit-exact, then the same
    log-probs from both."""
    from verl.workers import ActorWorker, TorchEngine
    _, other = _setup(seed=99)
    rollout = _rollout(other, tok, placement)
    metrics = rollout.sync_weights(actor)
    full = _full(actor.engine.module)
    synced = dict(other.named_parameters())
    mismatched = [n for n in full if not torch.equal(full[n], synced[n].detach())]
    lp_rollout = ActorWorker(TorchEngine(other, None, placement), ActorConfig(micro_batch_size=4),
                             **KW).compute_log_probs(batch)[0]
    return {"mismatched": mismatched, "n": len(full), "lp": (lp_rollout, actor.compute_log_probs(batch)[0]),
            "comm_bytes": metrics["perf/sync_comm_bytes"], "shared": metrics["perf/sync_shared"]}


@pytest.mark.multiprocess
def test_fsdp_engine_matches_torch_engine_and_syncs_bit_exactly():
    per_rank = run_distributed(_engine_body, 2, timeout=400)
    for rank, results in enumerate(per_rank):
        for case in ("plain", "clipped", "hsdp", "offload"):
            res = results[case]
            for key in ("lp", "ent", "values"):
                torch.testing.assert_close(res[key][1], res[key][0], rtol=1e-5, atol=1e-5, msg=f"{case} {key}")
            # the pre-clip norm over all shards equals the torch engine's norm of the whole averaged gradient
            assert res["grad_norm"][1] == pytest.approx(res["grad_norm"][0], rel=1e-5), (case, res["grad_norm"])
            assert res["critic_norm"][1] == pytest.approx(res["critic_norm"][0], rel=1e-5), case
            assert res["grad_norm"][0] > 1e-2 and res["moved"] > 1e-4, case  # the step did something
            assert res["params"] < 1e-5 and res["critic_params"] < 1e-5, (case, res["params"], res["critic_params"])
        assert results["plain"]["sharded"] == {"(Shard(dim=0),)"}
        assert results["hsdp"]["sharded"] == {"(Replicate(), Shard(dim=0))"}
        assert results["offload"]["offloaded"] == {"cpu"}
        for case, moved in (("clipped", True), ("hsdp", False)):
            sync = results[f"sync_{case}"]
            assert sync["n"] > 0 and sync["mismatched"] == [], (case, sync["mismatched"])
            assert torch.equal(*sync["lp"]), case
            # 1-D: each rank gathers the other's rows; HSDP with shard_size=1: every rank holds a whole copy
            assert sync["shared"] == 0.0 and (sync["comm_bytes"] > 0) == moved, (case, sync["comm_bytes"])
        fp32, bf16 = results["bf16"]["lp"]  # computed in bfloat16 (close, not equal), master weights float32
        assert 0 < float((bf16 - fp32).abs().max()) < 2e-2 and results["bf16"]["dtypes"] == {"torch.float32"}
        assert "fsdp.shard_size=3" in results["bad_shard_size"] and "[1, 2]" in results["bad_shard_size"]


def test_fsdp_shard_size_that_does_not_divide_the_world_fails_before_any_step():
    cfg = load_config(PPOConfig, None, ["actor.engine=fsdp", "actor.fsdp.shard_size=3", "data.train_batch_size=4",
                                        "actor.mini_batch_size=4"])
    with pytest.raises(VerlConfigError, match=r"actor\.fsdp\.shard_size=3 does not divide the role's 4 ranks"):
        cfg.validate_world(4)
    with pytest.raises(VerlConfigError, match="shard_size=0"):
        load_config(PPOConfig, None, ["actor.engine=fsdp", "critic.fsdp.shard_size=0"])


VOLATILE = ("perf/", "timing/", "resumed_from_step")


def _steps(out_dir: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in recs if "reward/mean" in r}


def length_reward(response: str, ground_truth: str, prompt: str) -> float:
    """Dense reward so that every step moves the weights."""
    return float(len(response))


def _train_body(rank, world, base, root):
    from verl.trainer.main_ppo import main
    main([*base, f"trainer.output_dir={root}/full", "trainer.total_steps=4"])
    main([*base, f"trainer.output_dir={root}/part", "trainer.total_steps=2", "trainer.save_every=2"])
    main([*base, f"trainer.output_dir={root}/part", "trainer.total_steps=4", "trainer.resume=auto"])
    return True


@pytest.mark.multiprocess
def test_fsdp_ppo_with_gae_on_two_ranks_resumes_exactly(tmp_path):
    base = [*TINY, "actor.engine=fsdp", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
            "reward.name=tests.workers.test_fsdp_engine:length_reward", "actor.optim.lr=1e-2",
            "actor.mini_batch_size=2", "actor.micro_batch_size=4", "trainer.plot=false"]
    run_distributed(_train_body, 2, args=(base, str(tmp_path)), timeout=500)
    full, part = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert sorted(part) == [1, 2, 3, 4]
    assert part == full  # bit-exact: sharded weights, optimizer state, schedules, RNG, data position
    assert all(full[s]["actor/grad_norm"] > 0 and full[s]["critic/grad_norm"] > 0 for s in full)
    assert full[3]["actor/entropy"] != full[4]["actor/entropy"]
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf_actor")
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.model.embed_tokens.weight
