"""Upstream verl's config keys as a dialect (verl.config.verl_dialect), checked against verl's own flattened trainer
YAMLs kept as test data in tests/compat/verl_upstream/ (source and commit in their header comments)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import yaml

from verl.config.base import from_dict, to_dict
from verl.config.ppo import PPOConfig
from verl.config.verl_dialect import (TABLE, VERL_DEFAULTS, VERL_MEGATRON_DEFAULTS, _flatten, _resolve, _set,
                                      is_verl_key, load_job, rule_for, translate)
from verl.errors import VerlConfigError

UPSTREAM = Path(__file__).parent / "verl_upstream"
YAMLS = {"_generated_ppo_trainer": False, "_generated_ppo_megatron_trainer": True}
DEFAULT_YAML = Path(__file__).parents[2] / "verl" / "trainer" / "config" / "default.yaml"


def upstream(name: str) -> dict:
    return yaml.safe_load((UPSTREAM / f"{name}.yaml").read_text())


def upstream_keys() -> dict[str, object]:
    out: dict[str, object] = {}
    for name in YAMLS:
        out.update(_flatten(upstream(name)))
    return out


def config_of(native: dict) -> dict:
    tree: dict = {}
    for k, v in native.items():
        _set(tree, k, v)
    return _flatten(to_dict(from_dict(PPOConfig, tree)))


def test_every_key_of_both_upstream_yamls_has_a_rule():
    """The coverage figure: every key maps, is refused with a reason (accepted only at values without effect), or
    is ignored with the reason why it has no effect here; none falls through."""
    keys = upstream_keys()
    assert len(keys) > 650
    kinds = collections.Counter("marker" if k.endswith("._target_") else rule_for(k).kind for k in keys
                                if rule_for(k) is not None)
    unknown = [k for k in keys if rule_for(k) is None]
    assert unknown == []
    assert sum(kinds.values()) == len(keys)
    assert kinds["map"] >= 150 and kinds["refuse"] >= 250
    assert all(r.why for r in TABLE), [r.pattern for r in TABLE if not r.why]
    print(f"\n{len(keys)} keys: {dict(kinds)}")


@pytest.mark.parametrize("name, megatron", YAMLS.items())
def test_upstream_yaml_translates_to_what_verl_defaults_give(name, megatron):
    """Translating verl's whole flattened YAML (its defaults, interpolations included) gives the same config as a
    command line with no key: VERL_DEFAULTS carries every default that matters."""
    pick = ["actor_rollout_ref.rollout.name=vllm"]  # verl leaves it mandatory ('???')
    full = translate(pick, upstream(name), defaults=False)
    assert full.refused == []
    assert config_of(full.native) == config_of(translate(pick, None, megatron=megatron).native)


def test_verl_defaults_are_verl_s():
    """Each value of VERL_DEFAULTS (and of the megatron trainer's) is verl's own, interpolations resolved."""
    for name, extra in (("_generated_ppo_trainer", {}), ("_generated_ppo_megatron_trainer", VERL_MEGATRON_DEFAULTS)):
        theirs = _resolve(_flatten(upstream(name)))
        ours = _resolve({**VERL_DEFAULTS, **extra})
        for key in {**VERL_DEFAULTS, **extra}:
            if key not in theirs:  # an FSDP trainer's key the megatron trainer does not have
                assert extra and key in _flatten(upstream("_generated_ppo_trainer")), key
                continue
            assert str(ours[key]).lower() == str(theirs[key]).lower(), (name, key, ours[key], theirs[key])


def native(overrides: list[str], **kw) -> dict:
    t = translate(overrides, **kw)
    assert t.refused == [], [(e.key, e.detail) for e in t.refused]
    return t.native


def test_unit_conversions():
    n = native(["trainer.n_gpus_per_node=4", "trainer.nnodes=2", "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                "critic.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "data.max_response_length=77",
                "actor_rollout_ref.rollout.top_k=-1", "trainer.test_freq=-1", "trainer.save_freq=-1"])
    assert n["actor.micro_batch_size"] == 8  # 64 over 4 x 2 processes
    assert n["critic.micro_batch_size"] == 3 and n["actor.max_tokens_per_micro_batch"] == 4096
    assert n["critic.max_tokens_per_micro_batch"] == 32768  # critic.use_dynamic_bsz follows the actor's by default
    assert n["rollout.max_new_tokens"] == 77 and n["rollout.top_k"] == 0 and n["trainer.test_freq"] == 0
    assert n["trainer.save_every"] == 0 and n["trainer.save_final"] is False
    t = translate(["trainer.n_gpus_per_node=4", "trainer.nnodes=2"])
    assert (t.world, t.nnodes) == (8, 2)


def test_run_length_and_output_folder():
    n = native(["trainer.total_epochs=3"])
    assert n["trainer.total_epochs"] == 3 and "trainer.total_steps" not in n
    n = native(["trainer.total_epochs=3", "trainer.total_training_steps=7"])  # verl lets the steps decide
    assert n["trainer.total_steps"] == 7 and n["trainer.total_epochs"] == 0
    n = native(["trainer.project_name=p", "trainer.experiment_name=e"])
    assert n["trainer.output_dir"] == "checkpoints/p/e"  # verl's default_local_dir interpolation
    assert native(["trainer.default_local_dir=/x/y"])["trainer.output_dir"] == "/x/y"


def test_clip_ratio_reads_and_loss_parameters():
    n = native(["actor_rollout_ref.actor.clip_ratio_low=null", "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert n["actor.clip_ratio_low"] == 0.3 and n["actor.clip_ratio_high"] == 0.2
    n = native(["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=2"])
    assert n["actor.policy_loss_params.tau_pos"] == 2.0
    t = translate(["actor_rollout_ref.actor.tau_pos=2"])  # vanilla: verl never reads it
    assert "actor.policy_loss_params.tau_pos" not in t.native
    assert next(e for e in t.entries if e.key.endswith("tau_pos")).kind == "ignore"


def test_validation_and_rejection_sampling_keys():
    n = native(["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.n=4",
                "actor_rollout_ref.rollout.val_kwargs.temperature=0.7", "data.val_files=[a.parquet,b.parquet]"])
    assert (n["val.temperature"], n["val.n"]) == (0.7, 4)
    assert n["data.val_files"] == ["a.parquet", "b.parquet"]
    assert native([])["val.temperature"] == 0.0  # do_sample=false: greedy
    rc = "algorithm.rollout_correction"
    n = native([f"{rc}.rollout_rs=seq_mean_k1", f"{rc}.rollout_rs_threshold=0.9_1.1", f"{rc}.rollout_is=token"])
    assert (n[f"{rc}.rejection_level"], n[f"{rc}.rejection_lower"], n[f"{rc}.rejection_upper"]) == \
        ("geometric", 0.9, 1.1)
    n = native([f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold=2.0"])
    assert (n[f"{rc}.rejection_lower"], n[f"{rc}.rejection_upper"]) == (0.5, 2.0)


def test_refusals_name_the_key_and_why():
    t = translate(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4", "algorithm.kl_penalty=full",
                   "actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.model.lora_rank=8",
                   "actor_rollout_ref.actor.profiler.tool=nsys", "actor_rollout_ref.actor.profiler.enable=true"])
    refused = {e.key: e.detail for e in t.refused}
    assert set(refused) == {"actor_rollout_ref.actor.ulysses_sequence_parallel_size", "algorithm.kl_penalty",
                            "actor_rollout_ref.rollout.name", "actor_rollout_ref.model.lora_rank",
                            "actor_rollout_ref.actor.profiler.tool", "actor_rollout_ref.actor.profiler.enable"}
    assert "Ulysses" in refused["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert "low_var_kl" in refused["algorithm.kl_penalty"]  # the closest setting
    with pytest.raises(VerlConfigError,
                       match=r"(?s)6 verl key\(s\) cannot be expressed.*ulysses_sequence_parallel_size=4"):
        t.check()
    # the same keys at values without effect are accepted (a profiler setting while the profiler is off)
    assert translate(["actor_rollout_ref.actor.profiler.tool=nsys"]).refused == []


def test_a_role_that_does_not_run_does_not_refuse():
    """critic.* keys cannot matter without gae, ref.* ones without a KL term."""
    path = "critic.model.path=/somewhere/else"
    assert translate(["algorithm.adv_estimator=grpo", path]).refused == []
    t = translate(["algorithm.adv_estimator=gae", "actor_rollout_ref.model.path=/m", path])
    assert [e.key for e in t.refused] == ["critic.model.path"]
    assert "starts from the policy" in t.refused[0].detail
    assert translate(["algorithm.adv_estimator=gae", "actor_rollout_ref.model.path=null",
                      "critic.model.path=null"]).refused == []


def test_unknown_keys_name_the_nearest_of_both_dialects():
    with pytest.raises(VerlConfigError, match=r"'actor_rollout_ref.actor.ppo_mini_bach_size'.*upstream verl "
                                              r"\(nearest: actor_rollout_ref.actor.ppo_mini_batch_size\)"):
        translate(["actor_rollout_ref.actor.ppo_mini_bach_size=4"])
    with pytest.raises(VerlConfigError, match=r"nor of this verl \(nearest: trainer.total_epochs\)"):
        translate(["trainer.total_epochz=4"])


def test_hydra_syntax():
    n = native(["+actor_rollout_ref.rollout.n=3", "++data.train_batch_size=8"])
    assert n["rollout.n"] == 3 and n["data.train_batch_size"] == 8
    # setting a parent replaces its subtree (the profiler settings below it are gone, not refused)
    t = translate(["actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler={}"])
    assert t.refused == []


def test_native_keys_mix_in_and_win():
    n = native(["actor_rollout_ref.rollout.name=vllm", "rollout.engine=torch", "rollout.tp=1", "warmup.steps=3"])
    assert n["rollout.engine"] == "torch" and n["warmup.steps"] == 3
    assert is_verl_key("actor_rollout_ref.rollout.n") and is_verl_key("trainer.total_training_steps")
    assert not is_verl_key("rollout.n") and not is_verl_key("data.train_files")  # ours (and verl's)


def test_load_job_dialects(tmp_path):
    cfg, t = load_job(["trainer.total_steps=3"], DEFAULT_YAML)
    assert t is None and cfg.trainer.total_steps == 3 and cfg.algorithm.adv_estimator == "grpo"  # our default job
    argv = ["actor_rollout_ref.rollout.name=torch", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    cfg, t = load_job(argv, DEFAULT_YAML)
    assert t is not None and cfg.algorithm.adv_estimator == "gae"  # verl's defaults, not our default job's
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.engine == "fsdp" and cfg.reward.name == "by_data_source"
    cfg, _ = load_job(["--config-name=ppo_megatron_trainer", *argv], DEFAULT_YAML)
    assert cfg.actor.engine == "megatron" and cfg.actor.megatron.params_dtype == "bfloat16"
    verl_yaml = tmp_path / "job.yaml"
    verl_yaml.write_text("hydra:\n  searchpath: [file://verl/trainer/config]\ndefaults:\n  - ppo_trainer\n  - _self_\n"
                         "actor_rollout_ref:\n  rollout: {name: torch, tensor_model_parallel_size: 1, n: 4}\n")
    cfg, t = load_job([str(verl_yaml), "actor_rollout_ref.rollout.n=6"], DEFAULT_YAML)
    assert t is not None and cfg.rollout.n == 6 and cfg.rollout.engine == "torch"
    cfg, t = load_job([f"--config-path={tmp_path}", "--config-name=job"], DEFAULT_YAML)
    assert cfg.rollout.n == 4
    with pytest.raises(VerlConfigError, match="cannot be expressed here"):
        load_job([*argv, "actor_rollout_ref.rollout.pipeline_model_parallel_size=2"], DEFAULT_YAML)
    # our YAML with a verl key appended: translated onto it, without verl's defaults
    cfg, t = load_job([str(DEFAULT_YAML), "actor_rollout_ref.rollout.n=4"], DEFAULT_YAML)
    assert t is not None and cfg.rollout.n == 4 and cfg.algorithm.adv_estimator == "grpo"
