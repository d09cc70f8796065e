"""The "kernels in other trainers" examples: the plain PyTorch loop trains, and the TRL subclass's fused loss equals
TRL's own loss (and gradients) on a tiny batch for every loss type it fuses."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import verl.ops as O

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def loop():
    return _load("kernels_in_plain_loop")


def test_plain_loop_trains_two_steps(loop):
    model = loop.build_model(vocab_size=512, hidden_size=64)
    before = model.get_output_embeddings().weight.detach().clone()
    cfg = loop.LoopConfig(steps=2, prompts=2, group=4, new_tokens=6, epochs=2)
    prompts = torch.randint(3, 512, (cfg.prompts, 5), generator=torch.Generator().manual_seed(0))
    history = loop.train(model, cfg, prompts, loop.low_id_reward(512))
    assert len(history) == 2
    assert all(math.isfinite(v) for rec in history for v in rec["losses"])
    # on-policy at the first epoch: ratio 1, so the clipped loss is -mean(A) = 0 for group-normalised advantages
    assert abs(history[0]["losses"][0]) < 1e-5
    assert not torch.equal(before, model.get_output_embeddings().weight)


@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo"])
def test_plain_loop_loss_matches_reference(loop, policy_loss):
    """The loss the loop trains on (fused head, or a registered loss after the fused log-probs) against the
    same formula on the whole [N, V] logits (verl.ops' reference backend), value and LM-head gradient."""
    torch.manual_seed(0)
    model = loop.build_model(vocab_size=300, hidden_size=32)
    cfg = loop.LoopConfig(policy_loss=policy_loss, kl_coef=0.01, entropy_coeff=0.01, new_tokens=5)
    ref_model = loop.build_model(vocab_size=300, hidden_size=32, seed=2)
    prompts = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(1))
    batch = loop.rollout(model, ref_model, prompts, loop.low_id_reward(300), cfg, torch.Generator().manual_seed(3))
    batch["old_logprob"] = batch["old_logprob"] + 0.1 * torch.randn_like(batch["old_logprob"])  # ratios != 1
    batch["mask"][0, -2:] = 0
    grads = []
    for backend in ("fused", "reference"):
        model.zero_grad(set_to_none=True)
        with O.backend(backend):
            loss = loop.grpo_loss(model, batch, cfg)
        loss.backward()
        grads.append((loss.detach(), model.get_output_embeddings().weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- TRL

def _trl():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed in this environment (the dev venv has none); these tests run in the "
                    "TRL environment: bash scripts/trl_check.sh")
    return _load("kernels_in_trl")


def _trainer(mod, tmp_path, **cfg):
    from trl import GRPOConfig

    path, tok, ds, reward = mod.demo_setup(str(tmp_path / "model"), vocab_size=400, hidden_size=32)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=6, report_to=[], save_strategy="no", seed=1,
                      disable_tqdm=True, **cfg)
    trainer = mod.VerlGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=ds,
                                  processing_class=tok)
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _inputs(trainer, beta: float, off_policy: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    B, P, C, V = 4, 5, 6, 400
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 3:] = 0
    completion_mask[2, 5:] = 0
    x = {"prompt_ids": torch.randint(3, V, (B, P), generator=g), "prompt_mask": prompt_mask,
         "completion_ids": torch.randint(3, V, (B, C), generator=g), "completion_mask": completion_mask,
         "advantages": torch.randn(B, generator=g), "num_items_in_batch": completion_mask.sum().float() * 2}
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, torch.cat([x["prompt_ids"],
                                                        x["completion_ids"]], 1),
                                                        torch.cat([prompt_mask, completion_mask], 1), C)[0]
    if off_policy:
        x["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)  # some ratios clip
    if beta:
        x["ref_per_token_logps"] = lp + 0.2 * torch.randn(lp.shape, generator=g)
    return x


CASES = [("grpo", 0.0, False, {}), ("grpo", 0.04, False, {}), ("bnpo", 0.04, True, {"use_bias_correction_kl": False}),
         ("dr_grpo", 0.0, True, {}), ("dapo", 0.04, False, {"entropy_coef": 0.01}),
         ("luspo", 0.0, True, {}), ("bnpo", 0.0, False, {"entropy_coef": 0.02})]


@pytest.mark.trl
@pytest.mark.parametrize("loss_type,beta,off_policy,extra", CASES)
def test_trl_subclass_loss_equals_trl(tmp_path, loss_type, beta, off_policy, extra):
    mod = _trl()
    from trl import GRPOTrainer
    trainer = _trainer(mod, tmp_path, loss_type=loss_type, beta=beta, **extra)
    trainer.model.train()
    x = _inputs(trainer, beta, off_policy)
    assert mod.fused_unsupported(trainer, x) is None
    out = []
    for compute in (lambda: GRPOTrainer._compute_loss(trainer, trainer.model, x),
                    lambda: trainer._compute_loss(trainer.model, x)):
        trainer.model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-5)
    for g_fused, g_trl in zip(out[1][1], out[0][1]):
        torch.testing.assert_close(g_fused, g_trl, atol=1e-5, rtol=1e-4)
    assert trainer._metrics["train"]["entropy"], "the fused path logs TRL's metrics"


@pytest.mark.trl
def test_trl_subclass_falls_back_with_a_named_reason(tmp_path):
    mod = _trl()
    from trl import GRPOTrainer
    trainer = _trainer(mod, tmp_path, loss_type="cispo")
    x = _inputs(trainer, 0.0, False)
    assert "cispo" in mod.fused_unsupported(trainer, x)
    with pytest.warns(UserWarning, match="loss_type='cispo'"):
        loss = trainer._compute_loss(trainer.model, x)
    torch.testing.assert_close(loss, GRPOTrainer._compute_loss(trainer, trainer.model, x))
