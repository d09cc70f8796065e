"""The typed config tree: YAML + dotted overrides, unknown keys with suggestions, type checks, batch-size
divisibility, and a docstring on every field."""

from __future__ import annotations

import dataclasses

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
    with pytest.raises(VerlConfigError, match="do not split over 4 ranks"):
        cfg.validate_world(4)
    cfg = load_config(PPOConfig, None, ["data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=3",
                                        "actor.micro_batch_size=5"])
    with pytest.raises(VerlConfigError, match="micro_batch_size=5 must divide"):
        cfg.validate_world(2)
    with pytest.raises(VerlConfigError, match="rollout.n >= 2"):
        load_config(PPOConfig, None, ["rollout.n=1", "algorithm.adv_estimator=grpo"])


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
    from pathlib import Path
    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))
    assert examples
    for path in examples:
        cfg = load_config(PPOConfig, path)
        cfg.validate_world(1)
