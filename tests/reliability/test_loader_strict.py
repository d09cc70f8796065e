"""The HF -> megatron loader is strict: checkpoint tensors the model would drop, and config features the megatron
model does not implement, are VerlConfigErrors naming them (tiny Llama-family checkpoints saved locally)."""

from __future__ import annotations

import json
import types

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from verl.errors import VerlConfigError
from verl.models import load_hf_checkpoint
from verl.models.checkpoint import unused_tensors
from verl.models.config import arch_from_hf
from verl.models.tiny import save_tiny, tiny_config, tiny_model


def _saved(tmp_path, family="llama", **kw):
    return save_tiny(tiny_model(family=family, **kw), None, tmp_path / "ckpt")


def _names(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _fake_model(path, value_head=False):
    """What load_hf_checkpoint reads before touching parameters: the architecture and the build options."""
    return types.SimpleNamespace(arch=arch_from_hf(AutoConfig.from_pretrained(str(path))),
                                 options=types.SimpleNamespace(value_head=value_head))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_behaves_clean_checkpoint_has_no_unused_tensors(tmp_path):
    path = _saved(tmp_path)
    model = _fake_model(path)
    assert unused_tensors(_names(path), model.arch) == []


def test_clear_bias_weights_under_a_config_without_bias_are_refused(tmp_path):
    """The silent-wrong-logits case: attention_bias weights whose config.json says no bias."""
    path = _saved(tmp_path, attention_bias=True)
    _edit_config(path, attention_bias=False)
    with pytest.raises(VerlConfigError, match=r"does not use: .*o_proj\.bias.*attention_bias"):
        load_hf_checkpoint(_fake_model(path), path)


def test_clear_extra_layer_is_refused(tmp_path):
    path = _saved(tmp_path, num_layers=3)
    _edit_config(path, num_hidden_layers=2)
    with pytest.raises(VerlConfigError, match=r"model\.layers\.2\."):
        load_hf_checkpoint(_fake_model(path), path)


def test_behaves_unused_tensors_are_listed_without_strict(tmp_path):
    path = _saved(tmp_path)
    names = _names(path) + ["model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert unused_tensors(names, _fake_model(path).arch) == ["model.layers.0.self_attn.o_proj.bias"]


def test_behaves_tied_head_and_critic_from_causal_lm_are_not_unused(tmp_path):
    tied = _saved(tmp_path, tie_word_embeddings=True)
    arch = _fake_model(tied).arch
    assert unused_tensors(_names(tied) + ["lm_head.weight"], arch) == []
    lm = save_tiny(tiny_model(), None, tmp_path / "lm")
    assert unused_tensors(_names(lm), _fake_model(lm).arch, value_head=True) == []
    # ...but a critic checkpoint's score head in an actor is
    assert unused_tensors(_names(lm) + ["score.weight"], _fake_model(lm).arch) == ["score.weight"]


def test_clear_extra_tensor_in_a_saved_file_is_named(tmp_path):
    path = _saved(tmp_path)
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.bias"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(VerlConfigError, match=r"model\.norm\.bias"):
        load_hf_checkpoint(_fake_model(path), path)


UNSUPPORTED = {
    "llama attention_bias": (dict(attention_bias=True), "attention_bias"),
    "llama mlp_bias": (dict(mlp_bias=True), "mlp_bias"),
    "gelu": (dict(hidden_act="gelu"), "hidden_act"),
    "rope yarn": (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    "rope dynamic": (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "dynamic"),
    "rope llama3 other low_freq_factor": (dict(max_position_embeddings=16384, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), "llama3"),
    "partial rotary": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_clear_unimplemented_llama_features_are_named(tmp_path, name):
    kw, word = UNSUPPORTED[name]
    tiny_config(family="llama", **kw).save_pretrained(tmp_path)
    with pytest.raises(VerlConfigError, match=word):
        arch_from_hf(AutoConfig.from_pretrained(str(tmp_path)))


@pytest.mark.parametrize("family,kw", [("mistral", dict(sliding_window=16)),
                                       ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                                      max_window_layers=0))])
def test_clear_sliding_window_shorter_than_the_context_is_refused(tmp_path, family, kw):
    tiny_config(family=family, **kw).save_pretrained(tmp_path)
    with pytest.raises(VerlConfigError, match=r"sliding_window=16 is shorter than max_position_embeddings"):
        arch_from_hf(AutoConfig.from_pretrained(str(tmp_path)))


def test_behaves_window_as_long_as_the_context_loads(tmp_path):
    tiny_config(family="mistral").save_pretrained(tmp_path)
    arch = arch_from_hf(AutoConfig.from_pretrained(str(tmp_path)))
    assert arch.sliding_window == arch.max_position_embeddings
