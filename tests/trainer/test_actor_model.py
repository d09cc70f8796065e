"""The Python API takes a Hugging Face model object as the actor (the seed article's `actor_model`), including
one loaded with `device_map=...`, whose `hf_device_map` is checked against the actor's ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.config import PPOConfig, load_config
from verl.data import task_corpus
from verl.distributed import init_placement
from verl.errors import VerlConfigError
from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
from verl.trainer.ppo_trainer import PPOTrainer

from tests.trainer.conftest import TINY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("actor")
    tok = tiny_tokenizer(task_corpus("arithmetic"))
    save_tiny(tiny_model(tokenizer=tok, seed=3), tok, path)
    return path


def _cfg(tmp_path, *extra):
    return load_config(PPOConfig, None, [*TINY, "warmup.steps=0", "trainer.total_steps=1", "trainer.export_hf=false",
                                         "trainer.plot=false", f"trainer.output_dir={tmp_path}", *extra])


def test_a_device_mapped_model_object_is_trained_in_place(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto")  # as the seed article loads it
    # on a CPU-only machine transformers sets no map for this load; on a GPU machine it names the devices
    model.hf_device_map = getattr(model, "hf_device_map", None) or {"model.embed_tokens": "cpu", "model": "cpu",
                                                                    "lm_head": "cpu"}
    before = [p.detach().clone() for p in model.parameters()]
    trainer = PPOTrainer(_cfg(tmp_path, "reward.name=tests.trainer.test_multiprocess:length_reward",
                              "actor.optim.lr=1e-2"), init_placement("cpu"), actor_model=model,
                         tokenizer=AutoTokenizer.from_pretrained(model_dir))
    trainer.fit()
    assert trainer.actor.engine.module is model  # trained in place, the caller's object
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("device_map, message", [
    ({"model.embed_tokens": "cpu", "model.layers": 1, "lm_head": "cpu"}, "puts 'model.layers' on device 1"),
    ({"": "disk"}, "puts 'the model' on disk"),
])
def test_a_device_map_that_conflicts_with_the_actor_ranks_is_refused(model_dir, tmp_path, device_map, message):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.hf_device_map = device_map  # what accelerate would have set for such a load
    with pytest.raises(VerlConfigError, match=message):
        PPOTrainer(_cfg(tmp_path), init_placement("cpu"), actor_model=model,
                   tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert not tmp_path.joinpath("checkpoints").exists()


def test_actor_model_needs_its_tokenizer(model_dir, tmp_path):
    with pytest.raises(VerlConfigError, match="needs tokenizer"):
        PPOTrainer(_cfg(tmp_path), init_placement("cpu"), actor_model=AutoModelForCausalLM.from_pretrained(model_dir))
