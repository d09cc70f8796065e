"""Each registered algorithm through one trainer micro-step, against the float64 transcriptions of
tests/algos/formulas.py: a loss or estimator wired to the wrong function (say cispo silently routed back to
vanilla) fails here even though it runs.

Every case builds the trainer from config (`verl train`'s path: PPOConfig -> PPOTrainer -> workers), runs one
train_step of the tiny job, and intercepts the step at its seams:
- the flow's outputs (scores, token rewards, values, advantages, returns, old / reference log-probs);
- the actor's update: its old log-probs are shifted by a fixed perturbation first (so ratios differ from 1 and
  every clip branch is taken), the formula's loss is computed on the model's own forward (transformers' logits,
  float64 log-softmax: a path independent of verl.ops) and backpropagated, and the update must report that loss
  (actor/pg_loss, actor/kl_loss) and that gradient norm (actor/grad_norm, before clipping);
- the critic's update likewise (critic/vf_loss, critic/grad_norm).
The reward is dense (the response's length) so that advantages are not all zero."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.distributed import init_placement
from verl.trainer.ppo_trainer import PPOTrainer

from tests.algos import formulas as F
from tests.algos.test_formulas import ESTIMATORS, KL_KINDS, POLICY_LOSSES, call_kwargs, oracle, params_fields
from tests.conftest import needs_ext
from tests.trainer.conftest import TINY

pytestmark = needs_ext

QUIET = ["trainer.total_steps=1", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
         "warmup.steps=0", "reward.name=tests.trainer.test_multiprocess:length_reward", "actor.entropy_coeff=0.0",
         "actor.ppo_epochs=1", "rollout.max_new_tokens=6", "actor.optim.grad_clip=1.0"]
SHIFT_SEED = 11


def _shift(like: torch.Tensor, scale: float = 0.3) -> torch.Tensor:
    return scale * torch.randn(like.shape, generator=torch.Generator().manual_seed(SHIFT_SEED)).to(like)


@torch.no_grad()
def _perturb(module: torch.nn.Module, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(3)
    for p in module.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g).to(p))


def _log_probs(module, batch, temperature: float) -> torch.Tensor:
    """log pi of the batch's response tokens, float64, from transformers' own logits (with autograd)."""
    P = batch.prompt_length
    logits = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False).logits[:, P - 1:-1]
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return lp.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def _grad_norm(module, loss) -> float:
    module.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in module.parameters() if p.grad is not None))
    module.zero_grad(set_to_none=True)
    return float(norm)


def run_step(tmp_path, overrides, *, actor_hook=None, critic_hook=None, before=None):
    """One train_step of the tiny job with `overrides`; hooks see (worker, args) before the real update and
    may replace the args; returns (the flow's outputs, the actor's and critic's update metrics, trainer)."""
    cfg = load_config(PPOConfig, None, [*TINY, *QUIET, f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    trainer = PPOTrainer(cfg, init_placement("cpu"))
    seen: dict = {}
    try:
        trainer.setup()
        if before is not None:
            before(trainer)
        run = trainer._run  # one run of the dataflow: its outputs are every key the nodes produced

        def flow_run(*args, **kw):
            seen["out"] = run(*args, **kw)
            return seen["out"]
        trainer._run = flow_run
        for name, hook in (("actor", actor_hook), ("critic", critic_hook)):
            worker = getattr(trainer, name)
            if hook is None or worker is None:
                continue
            update = worker.update

            def wrapped(batch, *args, _update=update, _hook=hook, _name=name, **kw):
                batch, args = _hook(trainer, batch, *args)
                seen[_name] = _update(batch, *args, **kw)
                return seen[_name]
            worker.update = wrapped
        trainer.train_step()
    finally:
        trainer.close()
    return seen, trainer


def _actor_module(trainer):
    return trainer.actor.engine.module


def loss_overrides(name: str) -> list[str]:
    """The loss and every hyperparameter it could read, explicitly (so no default matters)."""
    kw = call_kwargs(name)
    out = [f"actor.policy_loss={name}", f"actor.clip_ratio_low={kw['clip_low']}",
           f"actor.clip_ratio_high={kw['clip_high']}", f"actor.clip_ratio_c={kw['clip_c']}"]
    out += [f"actor.policy_loss_params.{k}={v}" for k, v in params_fields(name).items()]
    if name in ("clip_cov", "kl_cov"):  # their covariance is over one micro-batch (as upstream): make it the batch
        out.append("actor.micro_batch_size=16")
    return out


# ---------------------------------------------------------------------------------------------- policy losses

# every loss once with token-mean, and the ones upstream aggregates per sequence once more that way (the API test
# covers every mode; here the point is the wiring)
LOSS_CASES = [(n, "token-mean") for n in sorted(POLICY_LOSSES)] + \
    [(n, "seq-mean-token-mean") for n in ("vanilla", "gspo", "sapo", "cispo")]


@pytest.mark.parametrize("name,mode", LOSS_CASES)
def test_policy_loss_through_a_trainer_micro_step(tmp_path, name, mode):
    want = {}

    def hook(trainer, batch, old, adv, ref, *rest):
        module, T = _actor_module(trainer), trainer.cfg.rollout.temperature
        lp = _log_probs(module, batch, T)
        old = (lp.detach() + _shift(lp)).float()  # ratios away from 1: clips and masks engage
        loss, _ = oracle(name, lp, old.double(), adv.double(), batch.response_mask.double(), mode)
        want["loss"], want["grad_norm"] = float(loss.detach()), _grad_norm(module, loss)
        want["changed"] = float((adv.abs() > 0).sum())
        return batch, (old, adv, ref, *rest)

    seen, _ = run_step(tmp_path, [*loss_overrides(name), f"actor.loss_agg_mode={mode}"], actor_hook=hook)
    got = seen["actor"]
    assert want["changed"] > 0, "the step's advantages are all zero: the check would be empty"
    assert got["actor/pg_loss"] == pytest.approx(want["loss"], rel=2e-4, abs=1e-6), name
    assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3), name


def test_the_actor_passes_every_hyperparameter_it_reads():
    """The trainer builds the same call the API test checks (clip bounds and params), so a key dropped on the way
    from config to loss shows up in test_policy_loss_through_a_trainer_micro_step."""
    for name in POLICY_LOSSES:
        kw = call_kwargs(name)
        cfg = load_config(PPOConfig, None, loss_overrides(name))
        if "params" in kw:
            assert cfg.actor.loss_params() == kw["params"], name
        assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == \
               (kw["clip_low"], kw["clip_high"], kw["clip_c"]), name


# ---------------------------------------------------------------------------------------------- advantages



@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_advantage_estimator_through_a_trainer_micro_step(tmp_path, name):
    got = {}

    def hook(trainer, batch, old, adv, ref, *rest):
        got["adv"], got["batch"] = adv.clone(), batch
        return batch, (old, adv, ref, *rest)

    overrides = [f"algorithm.adv_estimator={name}", "algorithm.gamma=0.97", "algorithm.lam=0.9",
                 "algorithm.norm_adv_by_std_in_grpo=true"]  # the values ESTIMATORS' oracles take
    seen, trainer = run_step(tmp_path, overrides, actor_hook=hook)
    out, batch = seen["out"], got["batch"]
    mask = batch.response_mask.double()
    rewards = out["token_rewards"].double()
    values = out["values"].double() if "values" in out and out["values"] is not None else torch.zeros_like(mask)
    baseline = torch.zeros(len(mask), dtype=torch.float64)
    if name == "remax":
        n = trainer.cfg.rollout.n
        baseline = out["baseline_scores"].double().repeat_interleave(n)
    want = ESTIMATORS[name](rewards, mask, batch.group, values, baseline)
    assert float(F.where(mask, rewards).abs().sum()) > 0, "no reward in the batch: the check would be empty"
    torch.testing.assert_close(F.where(mask, got["adv"].double()), want, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(got["adv"], out["advantages"])  # what the flow computed is what the actor trained on
    if name == "gae":
        ret = F.gae(rewards, values, mask, 0.97, 0.9)[1]
        torch.testing.assert_close(F.where(mask, out["returns"].double()), ret, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- KL penalties

def _perturb_ref(trainer):
    _perturb(trainer.ref.engine.module)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_loss_through_a_trainer_micro_step(tmp_path, kind):
    want = {}

    def hook(trainer, batch, old, adv, ref, *rest):
        module, T = _actor_module(trainer), trainer.cfg.rollout.temperature
        lp = _log_probs(module, batch, T)
        m = batch.response_mask.double()
        pg, _ = oracle("vanilla", lp, lp.detach(), adv.double(), m, "token-mean")
        kl = F.aggregate(F.kl(lp, ref.double(), kind), m, "token-mean")
        want["kl"], want["grad_norm"] = float(kl.detach()), _grad_norm(module, pg + 0.5 * kl)
        return batch, (old, adv, ref, *rest)

    seen, _ = run_step(tmp_path, ["actor.use_kl_loss=true", f"actor.kl_loss_type={kind}", "actor.kl_loss_coef=0.5",
                                  "actor.policy_loss=vanilla", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28",
                                  "actor.clip_ratio_c=3.0"],
                       actor_hook=hook, before=_perturb_ref)
    got = seen["actor"]
    assert abs(want["kl"]) > 1e-4, "the reference equals the actor: the KL check would be empty"
    assert got["actor/kl_loss"] == pytest.approx(want["kl"], rel=2e-4, abs=1e-7), kind
    assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3), kind


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_in_reward_through_a_trainer_micro_step(tmp_path, kind):
    seen, trainer = run_step(tmp_path, ["algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={kind}",
                                        "algorithm.kl_ctrl.kl_coef=0.3"], before=_perturb_ref)
    out = seen["out"]
    batch = out["batch"]
    m = batch.response_mask.double()
    last = (m.sum(-1).long() - 1).clamp(min=0)
    score = torch.zeros_like(m)
    score[torch.arange(len(m)), last] = out["scores"].double()
    kl = F.kl(out["old_log_probs"].double(), out["ref_log_probs"].double(), kind)
    want = F.where(m, score - 0.3 * kl)
    assert float(F.where(m, kl).abs().sum()) > 1e-4
    torch.testing.assert_close(F.where(m, out["token_rewards"].double()), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- value loss

def test_value_loss_through_a_trainer_micro_step(tmp_path):
    want = {}

    def hook(trainer, batch, old_values, returns, *rest):
        module = trainer.critic.engine.module
        P = batch.prompt_length
        v = module(batch.input_ids, batch.attention_mask, batch.position_ids)[:, P - 1:-1].double()
        old = old_values + _shift(old_values, 0.5)  # some values leave the clip range
        loss, _ = F.value_loss(v, old.double(), returns.double(), batch.response_mask.double(), 0.2)
        want["loss"], want["grad_norm"] = float(loss.detach()), _grad_norm(module, loss)
        return batch, (old, returns, *rest)

    seen, _ = run_step(tmp_path, ["algorithm.adv_estimator=gae", "critic.cliprange_value=0.2"], critic_hook=hook)
    got = seen["critic"]
    assert got["critic/vf_loss"] == pytest.approx(want["loss"], rel=2e-4)
    assert got["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3)


# ---------------------------------------------------------------------------------------------- rollout correction

RC = {"is-token": ["algorithm.rollout_correction.is_level=token"],
      "is-sequence": ["algorithm.rollout_correction.is_level=sequence"],
      "is-token-unfused": ["algorithm.rollout_correction.is_level=token", "actor.fused_loss_head=false"],
      "reject-token": ["algorithm.rollout_correction.rejection_level=token"],
      "reject-sequence": ["algorithm.rollout_correction.rejection_level=sequence"],
      "reject-geometric": ["algorithm.rollout_correction.rejection_level=geometric"]}


@pytest.mark.parametrize("mode", sorted(RC))
def test_rollout_correction_through_a_trainer_micro_step(tmp_path, mode):
    want = {}

    def hook(trainer, batch, old, adv, ref, *rest):
        mu = batch.rollout_log_probs + _shift(batch.rollout_log_probs, 0.25)  # the engine's distribution moved
        batch = dataclasses.replace(batch, rollout_log_probs=mu)
        c = trainer.cfg.algorithm.rollout_correction
        m = batch.response_mask.double()
        module = _actor_module(trainer)
        lp = _log_probs(module, batch, trainer.cfg.rollout.temperature)
        # IS alone keeps the on-policy shortcut: no old-log-prob pass, pi_old is the update's own forward
        assert (old is None) == (c.rejection_level == "none"), mode
        pi_old = lp.detach() if old is None else old.double()
        keep = (F.rejection_keep(pi_old, mu.double(), m, c.rejection_level, c.rejection_lower,
                                 c.rejection_upper) if c.rejection_level != "none" else m.bool())
        w = F.is_weights(pi_old, mu.double(), m, c.is_level, c.is_cap) if c.is_level != "none" else None
        loss, _ = oracle("vanilla", lp, pi_old, adv.double(), keep.double(), "token-mean", w)
        want.update(loss=float(loss.detach()), grad_norm=_grad_norm(module, loss),
                    rejected=float((m.bool() & ~keep).sum() / m.sum()))
        return batch, (old, adv, ref, *rest)

    seen, _ = run_step(tmp_path, [*RC[mode], "algorithm.rollout_correction.is_cap=1.5",
                                  "algorithm.rollout_correction.rejection_lower=0.8",
                                  "algorithm.rollout_correction.rejection_upper=1.25", "actor.policy_loss=vanilla",
                                  "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28", "actor.clip_ratio_c=3.0"],
                       actor_hook=hook)
    got = seen["actor"]
    assert got["actor/pg_loss"] == pytest.approx(want["loss"], rel=2e-4, abs=1e-6), mode
    assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3), mode
    assert got["rollout_corr/rejected_frac"] == pytest.approx(want["rejected"], abs=1e-9)
    if mode.startswith("is"):
        assert 0 < got["rollout_corr/is_truncated_frac"] < 1 and got["rollout_corr/is_weight_max"] <= 1.5 + 1e-6
    if mode.startswith("reject"):
        assert 0 < want["rejected"] < 1, "the perturbation should reject some tokens and keep others"


def test_bypass_trains_on_the_rollout_log_probs_as_old(tmp_path):
    """algorithm.rollout_correction.bypass: the old log-probs the actor trains against are the rollout engine's,
    the very tensor, and the loss is PPO's against them."""
    want = {}

    def hook(trainer, batch, old, adv, ref, *rest):
        assert old is batch.rollout_log_probs, "bypass must hand the rollout's log-probs over as the old ones"
        module = _actor_module(trainer)
        lp = _log_probs(module, batch, trainer.cfg.rollout.temperature)
        loss, _ = oracle("vanilla", lp, old.double(), adv.double(), batch.response_mask.double(), "token-mean")
        want.update(loss=float(loss.detach()), grad_norm=_grad_norm(module, loss), old=old)
        return batch, (old, adv, ref, *rest)

    seen, _ = run_step(tmp_path, ["algorithm.rollout_correction.bypass=true", "actor.clip_ratio_low=0.2",
                                  "actor.clip_ratio_high=0.28", "actor.clip_ratio_c=3.0"], actor_hook=hook)
    out, got = seen["out"], seen["actor"]
    assert got["actor/pg_loss"] == pytest.approx(want["loss"], rel=2e-4, abs=1e-6)
    assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3)
    assert torch.equal(out["old_log_probs"], out["batch"].rollout_log_probs)
    assert torch.equal(want["old"], out["batch"].rollout_log_probs)
    assert "rollout/mismatch_max" not in seen["actor"]
