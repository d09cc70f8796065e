"""A table of bad job configs: each must be a VerlConfigError, raised while the config is loaded (before any model
is built), whose message names the key. Overrides and YAML files both go through `load_config`."""

from __future__ import annotations

import pytest

from verl.config import PPOConfig, load_config
from verl.errors import VerlConfigError

BAD = ("nan", ".nan", "inf", "-inf")

# (override, the dotted key the message must name)
NUMERIC = {
    # rates
    "actor.optim.lr": ["0", "-1e-6", *BAD], "critic.optim.lr": ["0", *BAD], "warmup.lr": ["0", "-1", *BAD],
    "actor.optim.min_lr": ["-1", "1", *BAD], "actor.optim.weight_decay": ["-0.1", *BAD],
    "actor.optim.eps": ["0", *BAD], "actor.optim.grad_clip": ["-1", *BAD], "actor.optim.warmup_steps": ["-1"],
    # coefficients
    "actor.entropy_coeff": ["-0.01", *BAD], "actor.kl_loss_coef": ["-1", *BAD],
    "algorithm.kl_ctrl.kl_coef": ["-0.1", *BAD], "algorithm.gamma": ["1.5", "-0.1", *BAD],
    "algorithm.lam": ["2", *BAD],
    # clip ratios
    "actor.clip_ratio_low": ["1", "-0.1", *BAD], "actor.clip_ratio_high": ["-0.2", "nan", "inf"],
    "actor.clip_ratio_c": ["1", "0.5", "nan", "-inf"], "critic.cliprange_value": ["-0.5", "nan", "-inf"],
    # sampling
    "rollout.temperature": ["0", "-1", *BAD], "rollout.top_p": ["0", "1.5", "-0.1", *BAD],
    "rollout.top_k": ["-1"], "rollout.sync_bucket_mb": ["0", "nan", "inf"],
    "rollout.gpu_memory_utilization": ["0", "1.5", "nan"], "rollout.n": ["0", "-2"],
    "rollout.max_new_tokens": ["0"], "rollout.max_batch_size": ["0"], "rollout.max_model_len": ["1"],
    # sizes and counts
    "data.train_batch_size": ["0"], "data.max_prompt_length": ["0"], "data.num_examples": ["0"],
    "actor.mini_batch_size": ["0"], "actor.micro_batch_size": ["-1"], "critic.micro_batch_size": ["0"],
    "actor.ppo_epochs": ["0"], "critic.warmup_steps": ["-1"], "trainer.total_steps": ["0"],
    "trainer.save_every": ["-1"], "trainer.keep_checkpoints": ["-1"], "trainer.collective_timeout_s": ["0", "nan"],
    "warmup.steps": ["-1"], "warmup.batch_size": ["0"],
    "model.tiny.hidden_size": ["0"], "model.tiny.num_heads": ["0"], "model.tiny.num_kv_heads": ["3"],
    "model.tiny.num_layers": ["-1"], "model.tiny.vocab_size": ["0"],
}
CASES: list[tuple[list[str], str]] = [([f"{k}={v}"], k) for k, vals in NUMERIC.items() for v in vals]
CASES += [
    # adaptive KL controller zeros (it divides by both)
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=nan"], "algorithm.kl_ctrl.target_kl"),
    # wrong types
    (["actor.optim.lr=fast"], "actor.optim.lr"), (["rollout.n=2.5"], "rollout.n"), (["rollout.n=many"], "rollout.n"),
    (["trainer.save_final=maybe"], "trainer.save_final"), (["actor.optim.betas=0.9"], "actor.optim.betas"),
    (["actor.optim.betas=[0.9,1.0]"], "actor.optim.betas"), (["actor.optim.betas=[0.9,nan]"], "actor.optim.betas"),
    (["data.train_files={a: 1}"], "data.train_files"), (["actor.use_kl_loss=[1]"], "actor.use_kl_loss"),
    # a section given a scalar
    (["algorithm=grpo"], "algorithm"), (["model=gpt2"], "model"), (["actor=5"], "actor"),
    (["actor.optim=adam"], "actor.optim"), (["rollout=vllm"], "rollout"), (["algorithm.kl_ctrl=1"],
                                                                          "algorithm.kl_ctrl"),
    # unknown keys and values under a value
    (["actor.optim.learning_rate=1e-6"], "actor.optim.learning_rate"), (["rolout.n=4"], "rolout.n"),
    (["actor.lr=1"], "actor.lr"), (["actor.optim.lr.x=1"], "actor.optim.lr"), (["=3"], "=3"),
    (["actor.optim.lr"], "actor.optim.lr"),
    # bad enums
    (["rollout.engine=vlm"], "rollout.engine"), (["actor.engine=fsdp2"], "actor.engine"),
    (["actor.loss_agg_mode=token_mean"], "actor.loss_agg_mode"), (["algorithm.adv_estimator=grpo2"],
                                                                  "algorithm.adv_estimator"),
    (["actor.policy_loss=ppo2"], "actor.policy_loss"), (["actor.kl_loss_type=k4"], "actor.kl_loss_type"),
    (["algorithm.kl_penalty=k9"], "algorithm.kl_penalty"), (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type"),
    (["model.dtype=fp8"], "model.dtype"), (["trainer.device=tpu"], "trainer.device"),
    (["reward.type=human"], "reward.type"), (["data.task=chess"], "data.task"),
]


@pytest.mark.parametrize("overrides,key", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_clear_bad_override_is_a_config_error_naming_the_key(overrides, key):
    with pytest.raises(VerlConfigError) as info:
        load_config(PPOConfig, None, overrides)
    assert key in str(info.value), str(info.value)


YAML_CASES = {
    "scalar section": ("model: gpt2\n", "model"),
    "scalar section nested": ("actor:\n  optim: adamw\n", "actor.optim"),
    "duplicate top-level key": ("rollout:\n  n: 4\nrollout:\n  n: 8\n", "rollout"),
    "duplicate nested key": ("actor:\n  optim:\n    lr: 1.0e-6\n    lr: 1.0e-3\n", "lr"),
    "nan in yaml": ("actor:\n  optim:\n    lr: .nan\n", "actor.optim.lr"),
    "inf in yaml": ("actor:\n  entropy_coeff: .inf\n", "actor.entropy_coeff"),
    "list for a section": ("trainer:\n  - 1\n", "trainer"),
    "unknown nested key": ("critic:\n  optim:\n    lrr: 1\n", "critic.optim.lrr"),
    "temperature zero": ("rollout:\n  temperature: 0\n", "rollout.temperature"),
    "clip ratio above 1": ("actor:\n  clip_ratio_low: 1.2\n", "actor.clip_ratio_low"),
}


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_clear_bad_yaml_is_a_config_error_naming_the_key(tmp_path, name):
    text, key = YAML_CASES[name]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(VerlConfigError) as info:
        load_config(PPOConfig, path)
    assert key in str(info.value), str(info.value)


def test_clear_duplicate_key_message_gives_both_lines(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  n: 4\n  temperature: 1.0\n  n: 8\n")
    with pytest.raises(VerlConfigError, match=r"'n' is written twice .*lines 2 and 4"):
        load_config(PPOConfig, path)


def test_clear_scalar_section_suggests_the_key_meant():
    with pytest.raises(VerlConfigError, match=r"did you mean 'algorithm\.adv_estimator=grpo'"):
        load_config(PPOConfig, None, ["algorithm=grpo"])
    with pytest.raises(VerlConfigError, match=r"did you mean 'model\.path=gpt2'"):
        load_config(PPOConfig, None, ["model=gpt2"])


def test_behaves_good_edges_still_load():
    """Values at the edge of each range, and the infinities that mean 'off', are accepted."""
    cfg = load_config(PPOConfig, None, [
        "actor.clip_ratio_low=0", "actor.clip_ratio_c=inf", "critic.cliprange_value=.inf", "actor.optim.grad_clip=0",
        "algorithm.gamma=0", "algorithm.lam=1", "rollout.top_p=1", "actor.entropy_coeff=0",
        "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.horizon=0"])
    assert cfg.actor.clip_ratio_c == float("inf") and cfg.critic.cliprange_value == float("inf")


def test_behaves_blank_section_means_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("actor:\nrollout:\n  n: 4\n")
    cfg = load_config(PPOConfig, path)
    assert cfg.actor.optim.lr == PPOConfig().actor.optim.lr and cfg.rollout.n == 4


def test_clear_adaptive_kl_controller_refuses_zeros_when_built_directly():
    from verl.trainer.kl_control import AdaptiveKLController
    with pytest.raises(VerlConfigError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)


def test_case_count():
    assert len(CASES) + len(YAML_CASES) >= 80
