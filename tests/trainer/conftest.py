"""Tiny settings shared by the trainer tests: a 1-layer model, 4 prompts x 4 responses, 4 new tokens."""

from __future__ import annotations

import pytest

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=64", "data.num_examples=64", "data.train_batch_size=4", "rollout.n=4",
        "rollout.max_new_tokens=4", "actor.mini_batch_size=4", "actor.micro_batch_size=8",
        "critic.micro_batch_size=8", "warmup.steps=5", "warmup.batch_size=8", "trainer.total_steps=2",
        "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.threads=1", "trainer.device=cpu",
        "val.num_examples=0"]  # no held-out split (the default job's); tests that validate ask for one


@pytest.fixture
def tiny_args(tmp_path):
    def make(*extra: str, out: str = "run") -> list[str]:
        return TINY + [f"trainer.output_dir={tmp_path / out}", *extra]
    return make
