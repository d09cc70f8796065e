"""Mixture-of-experts settings are checked before any model is built: router replay needs engines the table
says can record and replay routes, EP / ETP layouts that megatron-core cannot build, an MoE policy with TP but
no sequence parallelism, and replay of a dense model, each refused naming the values; `off` survives YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.config import PPOConfig, load_config
from verl.errors import VerlConfigError
from verl.models.tiny import tiny_config
from verl.trainer.ppo_trainer import check_moe_layout

MOE_JOB = Path(__file__).resolve().parents[2] / "examples" / "moe_tiny.yaml"


def test_moe_job_loads_and_off_is_not_a_boolean():
    cfg = load_config(PPOConfig, MOE_JOB)
    assert cfg.actor.router_replay == "rollout" and cfg.model.tiny.family == "qwen3_moe"
    cfg.validate_world(1)
    cfg.validate_world(2)
    # YAML 1.1 reads `off` as false: the Literal's spelling is restored
    assert load_config(PPOConfig, MOE_JOB, ["actor.router_replay=off"]).actor.router_replay == "off"


@pytest.mark.parametrize("override, expected", [
    ("rollout.engine=hf", r"rollout.engine=hf does not record them \(transformers' generate .*engines that do: "
                          r"\['torch'\]"),
    ("actor.engine=fsdp", r"actor.engine=fsdp cannot \(it runs the Hugging Face module's own routers.*\['megatron'\]"),
    ("actor.megatron.ep=0", r"actor.megatron.ep.*must be >= 1"),
    ("actor.megatron.moe_aux_loss_coeff=-1", r"moe_aux_loss_coeff.*must be >= 0"),
])
def test_refused_on_load(override, expected):
    with pytest.raises(VerlConfigError, match=expected):
        load_config(PPOConfig, MOE_JOB, [override])


def test_expert_layout_refused_with_the_world_size():
    cfg = load_config(PPOConfig, MOE_JOB, ["actor.megatron.ep=2", "actor.megatron.tp=2"])
    with pytest.raises(VerlConfigError, match=r"etp=2 x ep=2 x pp=1 = 4 does not divide the 2 ranks"):
        cfg.validate_world(2)
    load_config(PPOConfig, MOE_JOB, ["actor.megatron.ep=2"]).validate_world(2)


@pytest.mark.parametrize("overrides, hf, expected", [
    (["actor.megatron.ep=3"], dict(family="qwen3_moe", num_experts=4), r"ep=3 does not divide the 4 experts"),
    (["actor.megatron.tp=2"], dict(family="qwen3_moe", num_experts=4), r"needs actor.megatron.sequence_parallel=true"),
    ([], dict(family="llama"), r"the policy \(llama\) has no experts"),
    (["actor.router_replay=off", "actor.megatron.ep=2"], dict(family="qwen3"), r"qwen3 has no experts"),
])
def test_model_decides_before_any_build(overrides, hf, expected):
    cfg = load_config(PPOConfig, MOE_JOB, overrides)
    with pytest.raises(VerlConfigError, match=expected):
        check_moe_layout(cfg, tiny_config(**hf))
