"""End to end through `verl.trainer.main_ppo.main`: GRPO and PPO on a tiny model, every advantage estimator,
KL in reward and in loss, outputs on disk, and bad input failing before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rewards import register_reward
from verl.trainer.main_ppo import main
from verl.trainer.ppo_flow import ppo_nodes
from verl.distributed import Placement
from verl.trainer.ppo_trainer import PPOTrainer


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_run_writes_metrics_checkpoint_plot_and_hf_export(tmp_path, tiny_args):
    assert main(tiny_args("trainer.total_steps=3", "trainer.save_every=2", "trainer.keep_checkpoints=0",
                          "trainer.tensorboard=true", "trainer.progress_bar=true")) == 0
    out = tmp_path / "run"
    steps = [r for r in _metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values())
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["perf/tokens_per_s"] > 0 and "actor/entropy" in r
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (out / "curves.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out / "hf_actor")
    tok = AutoTokenizer.from_pretrained(out / "hf_actor")
    assert model.config.model_type == "llama" and tok.eos_token == "</s>"


def test_ppo_with_critic_and_kl_in_reward(tmp_path, tiny_args):
    main(tiny_args("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                   "actor.ppo_epochs=2", "actor.mini_batch_size=2", "actor.micro_batch_size=4",
                   "trainer.save_final=false", "trainer.export_hf=false"))
    steps = [r for r in _metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 2
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/kl", "actor/kl_coef", "actor/pg_clipfrac"):
        assert key in steps[-1] and math.isfinite(steps[-1][key]), key
    # the adaptive controller moved the coefficient away from its start after the first step
    assert steps[1]["actor/kl_coef"] != 0.001


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "reinforce_plus_plus", "remax"])
def test_critic_free_estimators_run(tmp_path, tiny_args, estimator):
    main(tiny_args(f"algorithm.adv_estimator={estimator}", "actor.use_kl_loss=true", "trainer.total_steps=1",
                   "trainer.trace_step=1",
                   "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false", "warmup.steps=0"))
    (step,) = [r for r in _metrics(tmp_path / "run") if "reward/mean" in r]
    assert "actor/kl_loss" in step and "critic/vf_loss" not in step
    trace = json.loads((tmp_path / "run" / "trace_step_1.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {"generate", "ref_log_prob", "update_actor"} <= {e.get("name") for e in events}


def test_flow_is_chosen_by_config():
    names = lambda *o: [n.__name__ if hasattr(n, "__name__") else n.name for n in ppo_nodes(load_config(PPOConfig, None, list(o)))]  # noqa: E731
    assert names("algorithm.adv_estimator=gae") == ["generate", "reward", "values", "no_reference", "old_log_prob",
                                                   "token_rewards", "critic_advantage", "update_critic",
                                                   "generation_metrics", "update_actor", "sync_weights"]
    assert names() == ["generate", "reward", "no_reference", "old_log_prob", "token_rewards", "group_advantage",
                       "generation_metrics", "update_actor", "sync_weights"]
    assert names("trainer.mode=async")[-1] == "publish_weights"
    assert "ref_log_prob" in names("actor.use_kl_loss=true") and "generate_baseline" in names("algorithm.adv_estimator=remax")
    # a newly registered estimator brings its needs: the flow takes the critic nodes without an edit
    assert names("algorithm.adv_estimator=test_critic_estimator") == names("algorithm.adv_estimator=gae")


from verl.algos import get_advantage, register_advantage  # noqa: E402


@register_advantage("test_critic_estimator", needs_critic=True)
def _critic_estimator(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0,
                      lam=1.0, eps=1e-6, norm_by_std=True, check_finite=True):
    """GAE with lambda 0.9: any estimator that reads a critic's values."""
    return get_advantage("gae")(token_level_rewards, response_mask, values=values, gamma=gamma, lam=0.9)


def test_bad_inputs_fail_before_writing(tmp_path, tiny_args):
    out = tmp_path / "run"
    with pytest.raises(VerlConfigError, match="not a Hugging Face model directory"):
        main(tiny_args(f"model.path={tmp_path / 'nope'}"))
    with pytest.raises(VerlConfigError, match="data.train_batch_size=4 prompts do not split over 3 actor ranks"):
        PPOTrainer(load_config(PPOConfig, None, tiny_args()), Placement.layout(dp=3))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(VerlConfigError, match="no column 'prompt'"):
        main(tiny_args(f"data.train_files={bad}"))
    assert not out.exists()


def _always_nan(response, gt, prompt):
    return float("nan")


def test_nan_reward_stops_the_step(tmp_path, tiny_args):
    register_reward("test_always_nan")(_always_nan)
    with pytest.raises(VerlRuntimeError, match=r"node 'reward'.*test_always_nan.*finite float"):
        main(tiny_args("reward.name=test_always_nan", "warmup.steps=0"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_reward_raising_in_step_2_names_the_sample_and_writes_nothing_for_that_step(tmp_path, tiny_args):
    calls = []

    def fails_on_step_2(response, gt, prompt):
        calls.append(response)
        if len(calls) == 16 + 4:  # 4 prompts x 4 responses per step: the 4th sample (index 3) of step 2
            raise ZeroDivisionError("bad sample")
        return 0.5

    register_reward("test_fails_on_step_2")(fails_on_step_2)
    with pytest.raises(VerlRuntimeError, match=r"node 'reward'.*raised ZeroDivisionError: bad sample on sample 3 "
                                               r"\(response '.*', ground truth '\d+'\)"):
        main(tiny_args("reward.name=test_fails_on_step_2", "warmup.steps=0", "trainer.save_every=1"))
    out = tmp_path / "run"
    assert [r["step"] for r in _metrics(out) if "reward/mean" in r] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_registered_critic_estimator_trains_the_critic(tmp_path, tiny_args):
    main(tiny_args("algorithm.adv_estimator=test_critic_estimator", "trainer.total_steps=1", "trainer.save_final=false",
                   "trainer.export_hf=false", "trainer.plot=false"))
    (step,) = [r for r in _metrics(tmp_path / "run") if "reward/mean" in r]
    assert math.isfinite(step["critic/vf_loss"]) and step["critic/grad_norm"] >= 0


@pytest.mark.parametrize("engine", ["hf", "torch"])
def test_every_local_rollout_engine_trains_through_the_trainer(tmp_path, tiny_args, engine):
    """`rollout.engine=hf` failed on every run (no engine statistics) while no test ran it through the trainer."""
    assert main(tiny_args(f"rollout.engine={engine}", "trainer.save_final=false", "trainer.export_hf=false",
                          "trainer.plot=false")) == 0
    steps = [r for r in _metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 2 and all(0.0 <= r["rollout/padded_share"] < 1.0 for r in steps)


def test_int8_rollout_trains_with_token_is_and_reports_the_mismatch(tmp_path, tiny_args):
    """rollout.quantization=int8: the rollout decodes with int8 weights (every projection and the head), the
    trained copy stays float32 (the sync sends and the checkpoint holds float32), token-level truncated IS is on
    without being asked for, and the mismatch is logged beside its correction; an explicit is_level wins."""
    assert main(tiny_args("rollout.quantization=int8", "trainer.total_steps=2", "trainer.save_final=true")) == 0
    steps = [r for r in _metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/quantized_layers"] > 0 and r["rollout/unquantized_layers"] == 0
        assert r["rollout/mismatch_kl"] > 0 and "rollout_corr/is_weight_mean" in r
    cfg = load_config(PPOConfig, None, ["rollout.quantization=int8"])
    assert cfg.algorithm.rollout_correction.is_level == "token" and cfg.on_policy  # weights from the update's forward
    explicit = load_config(PPOConfig, None, ["rollout.quantization=int8",
                                             "algorithm.rollout_correction.is_level=sequence"])
    assert explicit.algorithm.rollout_correction.is_level == "sequence"
    assert load_config(PPOConfig, None, []).algorithm.rollout_correction.is_level == "none"
