"""The SGLang engine. SGLang needs a CUDA GPU (its CPU backend needs sgl-kernel built from source for CPU; PyPI
has only the CUDA build), so on CPU machines only the refusal is tested and the rest skips with
the reason. On a GPU machine with sglang installed: generation equal to transformers' (greedy, float32),
pushes in both weight formats through Engine.update_weights_from_tensor, and clear push errors."""

from __future__ import annotations

import pytest
import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import SamplingParams
from verl.rollout.config import RolloutConfig
from verl.rollout.sglang_engine import SGLangRollout, sglang_available

from tests.conftest import HARDWARE

_ok, _why = sglang_available()
_gpu = torch.cuda.is_available()
# Without a CUDA GPU SGLang cannot run at all: a hardware skip. With one, a missing sglang is a dependency problem.
needs_sglang = pytest.mark.skipif(not _ok, reason=(HARDWARE + "SGLang needs a CUDA GPU; this machine has none")
                                  if not _gpu else _why)

PROMPTS = ["the quick brown", "one two three four five six", [1, 86, 74, 71]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_refuses_to_start_where_it_cannot_run_and_says_why(tmp_path):
    if _ok:
        pytest.skip(HARDWARE + "a CUDA GPU with SGLang is here, so nothing refuses; the tests below cover it")
    assert "sglang" in _why.lower() and ("gpu" in _why.lower() or "install" in _why.lower())
    with pytest.raises(VerlConfigError, match="sglang rollout engine cannot run here"):
        SGLangRollout(RolloutConfig(engine="sglang"), str(tmp_path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    return str(save_tiny(tiny_model(tokenizer=tok, seed=0, hidden_size=128, num_heads=4, num_kv_heads=2,
                                    intermediate_size=256, max_position_embeddings=512), tok,
                         tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def engine(model_dir):
    return SGLangRollout(RolloutConfig(engine="sglang", gpu_memory_utilization=0.3, max_model_len=64), model_dir)


def _hf_after_push(model_dir, seed):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    hf.load_state_dict({k: v + 0.3 * torch.randn(v.shape, generator=g) * v.std() for k, v in hf.state_dict().items()})
    return hf


def _greedy(hf, engine, n=12):
    out = []
    for p in PROMPTS:
        ids = torch.tensor([engine.tokenizer.encode_prompt(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        out.append(ref[0, ids.shape[1]:].tolist())
    return out


@needs_sglang
def test_push_in_the_hf_format_then_generate_what_transformers_generates(engine, model_dir):
    hf = _hf_after_push(model_dir, seed=5)
    assert engine.update_weights(iter(hf.state_dict().items())) == len(hf.state_dict())
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == _greedy(hf, engine)


@needs_sglang
def test_push_in_the_fused_format_is_loaded_as_is(engine, model_dir):
    hf = _hf_after_push(model_dir, seed=6)
    sd = hf.state_dict()
    fused = {}
    for k, v in sd.items():
        if ".q_proj." in k:
            fused[k.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [v, sd[k.replace(".q_proj.", ".k_proj.")], sd[k.replace(".q_proj.", ".v_proj.")]])
        elif ".gate_proj." in k:
            up = sd[k.replace(".gate_proj.", ".up_proj.")]
            fused[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([v, up])
        elif not any(f".{p}." in k for p in ("k_proj", "v_proj", "up_proj")):
            fused[k] = v
    engine.update_weights(fused.items())
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == _greedy(hf, engine)


@needs_sglang
def test_bad_pushes_and_long_prompts_fail_clearly(engine):
    with pytest.raises(VerlRuntimeError, match="no weight named 'model.layers.0.attn.wq.weight'"):
        engine.update_weights([("model.layers.0.attn.wq.weight", torch.zeros(2))])
    with pytest.raises(VerlRuntimeError, match=r"has shape \(3, 3\), but the engine expects \(128,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3, 3))])
    with pytest.raises(VerlConfigError, match="prompt 0 has 64 tokens"):
        engine.generate([[1] * 64], GREEDY)
