"""The typed config tree: YAML + dotted overrides, unknown keys with suggestions, type checks, batch-size
divisibility, and a docstring on every field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from verl.config import PPOConfig, describe, field_docs, load_config
from verl.config.base import _dataclass_type, _hints
from verl.errors import VerlConfigError
from verl.trainer.main_ppo import DEFAULT_CONFIG


def test_default_yaml_and_overrides():
    cfg = load_config(PPOConfig, DEFAULT_CONFIG, ["actor.optim.lr=1e-6", "rollout.n=4", "trainer.resume=auto",
                                                  "data.train_files=a.jsonl,b.parquet", "actor.use_kl_loss=true"])
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.n == 4 and cfg.trainer.resume == "auto"
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]
    assert cfg.actor.use_kl_loss is True and cfg.needs_ref
    assert load_config(PPOConfig, DEFAULT_CONFIG, ["trainer.resume=null"]).trainer.resume is None


@pytest.mark.parametrize("override, expected", [
    ("actor.optim.lrr=1", "did you mean 'lr'"),
    ("actr.ppo_epochs=2", "did you mean 'actor'"),
    ("algorithm.adv_estimator=grp", "did you mean 'grpo'"),
    ("rollout.n=four", "expected an integer"),
    ("actor.optim.lr.x=1", "is a value, not a section"),
    ("trainer.total_steps", "must look like"),
])
def test_bad_override_names_the_key(override, expected):
    with pytest.raises(VerlConfigError, match=expected):
        load_config(PPOConfig, DEFAULT_CONFIG, [override])


def test_unknown_yaml_key_suggests(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("actor:\n  optim:\n    learning_rate: 1.0e-5\n")
    with pytest.raises(VerlConfigError, match=r"'actor\.optim\.learning_rate'.*valid keys"):
        load_config(PPOConfig, p)
    with pytest.raises(VerlConfigError, match="does not exist"):
        load_config(PPOConfig, tmp_path / "missing.yaml")


def test_batch_divisibility_checked_with_world_size():
    cfg = load_config(PPOConfig, None, ["data.train_batch_size=6", "actor.mini_batch_size=6", "rollout.n=4",
                                        "actor.micro_batch_size=4"])
    cfg.validate_world(1)
    cfg.validate_world(2)
    with pytest.raises(VerlConfigError, match="do not split over 4 actor ranks"):
        cfg.validate_world(4)
    cfg = load_config(PPOConfig, None, ["data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=3",
                                        "actor.micro_batch_size=5"])
    with pytest.raises(VerlConfigError, match="micro_batch_size=5 must divide"):
        cfg.validate_world(2)
    with pytest.raises(VerlConfigError, match="rollout.n >= 2"):
        load_config(PPOConfig, None, ["rollout.n=1", "algorithm.adv_estimator=grpo"])


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("path", ["verl/trainer/config/default.yaml", "examples/ppo_gae.yaml"])
def test_micro_batches_clamp_to_a_ranks_share(path, world):
    """The default job and the GAE example were written for one process; on 2 and 4 their micro-batches are
    more than a rank's share, which is clamped (and said once), not refused."""
    cfg = load_config(PPOConfig, ROOT / path)
    notes = cfg.validate_world(world)
    actor_share = cfg.actor.mini_batch_size // world * cfg.rollout.n
    critic_share = cfg.data.train_batch_size * cfg.rollout.n // world
    want = [f"actor.micro_batch_size={cfg.actor.micro_batch_size} is more than the {actor_share} responses"] \
        if cfg.actor.micro_batch_size > actor_share else []
    if cfg.needs_critic and cfg.critic.micro_batch_size > critic_share:
        want.append(f"critic.micro_batch_size={cfg.critic.micro_batch_size} is more than the {critic_share} responses")
    assert len(notes) == len(want) and all(n.startswith(w) for n, w in zip(notes, want)), notes
    assert (world == 1) == (notes == [])


def test_micro_batches_that_do_not_split_a_share_stay_errors():
    default = ROOT / "verl/trainer/config/default.yaml"
    with pytest.raises(VerlConfigError, match=r"actor.micro_batch_size=48 must divide the 128 responses"):
        load_config(PPOConfig, default, ["actor.micro_batch_size=48"]).validate_world(2)
    with pytest.raises(VerlConfigError, match=r"critic.micro_batch_size=24 must divide the responses each of the "
                                              r"critic's 2 data-parallel ranks gets .* = 32\)"):
        load_config(PPOConfig, ROOT / "examples/ppo_gae.yaml", ["critic.micro_batch_size=24"]).validate_world(2)
    with pytest.raises(VerlConfigError, match="do not split over 3 actor ranks"):
        load_config(PPOConfig, default).validate_world(3)


def _walk(cls):
    yield cls
    for name, tp in _hints(cls).items():
        sub = _dataclass_type(tp)
        if sub is not None:
            yield from _walk(sub)


def test_every_field_documented_and_slots():
    for cls in _walk(PPOConfig):
        assert dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__"), cls
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    lines = describe(PPOConfig)
    assert any(line.startswith("actor.optim.lr = ") for line in lines)


def test_example_configs_load():
    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))
    assert examples
    for path in examples:
        cfg = load_config(PPOConfig, path)
        # a split example names the ranks it needs; the others run on one process
        cfg.validate_world(1 + max([0, *(r for k in ("actor", "critic", "reward", "rollout")
                                         for r in (getattr(cfg, k).ranks or []))]))


def test_the_generation_layout_and_engine_are_checked_before_any_step(tmp_path, tiny_args):
    """Each fails before any step (and before anything is written), naming the bad value."""
    from verl.trainer.main_ppo import main
    cfg = load_config(PPOConfig, None, ["rollout.engine=vllm", "rollout.tp=4", "data.train_batch_size=8",
                                        "actor.mini_batch_size=8"])
    with pytest.raises(VerlConfigError, match="rollout.tp=4 must divide the 2 rollout ranks"):
        cfg.validate_world(2)
    # megatron TP=2 over 2 ranks is one training replica, generated by two (rollout.tp=1)
    cfg = load_config(PPOConfig, None, ["rollout.engine=vllm", "data.train_batch_size=3", "actor.mini_batch_size=3",
                                        "actor.micro_batch_size=8", "actor.engine=megatron", "actor.megatron.tp=2"])
    with pytest.raises(VerlConfigError, match="train_batch_size=3 prompts do not split over the 2 generation replicas"):
        cfg.validate_world(2)
    with pytest.raises(VerlConfigError, match="rollout.tp=2 with rollout.engine=torch"):
        load_config(PPOConfig, None, ["rollout.tp=2"])
    with pytest.raises(VerlConfigError, match="rollout.decoder=train .* needs rollout.engine=torch and actor.engine=torch"):
        load_config(PPOConfig, None, ["rollout.decoder=train", "actor.engine=megatron"])
    with pytest.raises(VerlConfigError, match="compare_full_gather times the full gather of a model-parallel actor.*megatron"):
        load_config(PPOConfig, None, ["rollout.compare_full_gather=true"])
    out = tmp_path / "run"
    with pytest.raises(VerlConfigError, match="rollout.engine=sglang cannot run here: sglang"):
        main(tiny_args("rollout.engine=sglang"))
    from types import SimpleNamespace
    from verl.trainer.ppo_trainer import check_generation_layout
    with pytest.raises(VerlConfigError, match="rollout.tp=3 does not divide the model's 4 attention heads"):
        check_generation_layout(load_config(PPOConfig, None, ["rollout.engine=vllm", "rollout.tp=3"]),
                                SimpleNamespace(num_attention_heads=4, max_position_embeddings=128))
    with pytest.raises(VerlConfigError, match=r"max_prompt_length=32 \+ rollout.max_new_tokens=200 = 232 exceeds the "
                                              r"maximum model length 128"):
        main(tiny_args("rollout.max_new_tokens=200", "model.tiny.max_position_embeddings=128"))
    assert not out.exists()


@pytest.mark.parametrize("overrides, world, message", [
    (["trainer.placement=split", "critic.ranks=[2,4]"], 4, r"critic.ranks=\[2, 4\] names ranks \[4\] outside the world of 4"),
    (["trainer.placement=split", "critic.ranks=[]"], 4, r"critic.ranks=\[\] must be a non-empty list"),
    (["trainer.placement=split", "actor.ranks=[1, 2]", "rollout.ranks=[1, 2]"], 4, "must include rank 0"),
    (["trainer.placement=split", "rollout.ranks=[0]"], 4, r"rollout.ranks=\[0\] partly overlaps actor.ranks=\[0, 1\]"),
    (["critic.ranks=[1]"], 2, r"critic.ranks=\[1\] with trainer.placement=colocated"),
    (["trainer.placement=split"], 1, "trainer.placement=split .* needs at least 2 processes"),
    (["trainer.placement=split", "rollout.engine=vllm", "critic.ranks=[0,1,2,3]", "algorithm.adv_estimator=gae"], 4,
     r"critic.ranks=\[0, 1, 2, 3\] overlaps the vllm rollout on ranks \[0, 1\].*rollout.cpu_offload=true"),
    (["actor.engine=megatron", "actor.cpu_offload=true"], 2, "actor.cpu_offload=true but its engine 'megatron' cannot"),
    (["trainer.placement=split", "reward.cpu_offload=true"], 2, "reward.cpu_offload=true but its engine 'rule' cannot"),
    (["trainer.placement=split", "actor.engine=megatron"], 4, r"actor.ranks=\[0, 1\] with the megatron engine, whose parallel state spans every rank"),
    (["actor.engine=fsdp", "actor.fsdp.shard_size=3"], 4, "actor.fsdp.shard_size=3 does not divide the role's 4 ranks"),
    (["trainer.placement=split", "algorithm.adv_estimator=gae", "critic.engine=fsdp", "critic.fsdp.shard_size=4"], 4,
     "critic.fsdp.shard_size=4 does not divide the role's 2 ranks"),
])
def test_placement_errors_name_the_role_and_value(overrides, world, message):
    """Each bad placement fails when the job is validated (before any model is built), naming the role."""
    base = ["data.train_batch_size=8", "actor.mini_batch_size=8", "actor.micro_batch_size=8", "rollout.n=4"]
    with pytest.raises(VerlConfigError, match=message):
        load_config(PPOConfig, None, base + overrides).validate_world(world)


def test_engines_a_role_cannot_run_are_refused_on_load():
    with pytest.raises(VerlConfigError, match="critic.engine.*'vllm'"):
        load_config(PPOConfig, None, ["critic.engine=vllm"])
    with pytest.raises(VerlConfigError, match="actor.engine.*'sglang'"):
        load_config(PPOConfig, None, ["actor.engine=sglang"])


@pytest.mark.parametrize("path, world", [("examples/split_placement.yaml", 4), ("examples/seed_8_devices.yaml", 8)])
def test_placement_examples_load_and_validate(path, world):
    from verl.trainer.ppo_flow import node_configs
    cfg = load_config(PPOConfig, Path(__file__).parents[2] / path)
    cfg.validate_world(world)
    nodes = node_configs(cfg, cfg.roles(world))
    if world == 8:  # the seed's three placements: vLLM on 0-3, the reward model on 4-5 offloaded, the critic on all 8
        where = {n: (c.device_map, c.engine, c.cpu_offload) for n, c in nodes.items()}
        assert where["generate"] == ((0, 1, 2, 3), "vllm", True)
        assert where["reward"] == ((4, 5), "torch", True)
        assert where["update_critic"] == (tuple(range(8)), "fsdp", False)
    else:
        assert nodes["reward"].device_map == nodes["values"].device_map == (2, 3)
        assert nodes["generate"].device_map == nodes["update_actor"].device_map == (0, 1)
