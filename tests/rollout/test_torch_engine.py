"""The torch rollout engine and the shared interface: exact greedy decoding against transformers, left
padding, sampling controls, stop criteria, log-probs, seeded reproducibility, device_map models, weight
updates, release/resume and errors."""

from __future__ import annotations

import math

import pytest
import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout import RolloutConfig, SamplingParams, Tokenizer, TorchRollout, build_rollout
from verl.models.tiny import tiny_model, tiny_tokenizer
from tests.conftest import HARDWARE

PROMPTS = ["the quick brown", "one two three four five six", "what", [1, 86, 74]]
# A wide initialisation gives peaked, varied next-token distributions (the sampling tests need both).
SHAPE = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tokenizer=tok, **SHAPE)


@pytest.fixture(scope="module")
def engine(model, tok):
    return TorchRollout(model, tok, RolloutConfig(max_batch_size=3))


def _hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers_generate_in_a_left_padded_batch(engine, model, tok):
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert len(outs) == len(PROMPTS)
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        ids = Tokenizer(tok).encode_prompt(p)
        assert o.prompt_index == i and o.prompt_token_ids == ids
        assert o.token_ids == _hf_greedy(model, ids, 10)
        assert o.finish_reason == "length" and o.text == tok.decode(o.token_ids, skip_special_tokens=True)


def test_kv_cache_and_recompute_agree(model, tok):
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=1, logprobs=True, ignore_eos=True)
    a = TorchRollout(model, tok).generate(PROMPTS[:2], sp)
    b = TorchRollout(model, tok, RolloutConfig(kv_cache=False)).generate(PROMPTS[:2], sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_logprobs_are_those_of_the_sampling_distribution(engine, model, tok):
    sp = SamplingParams(max_new_tokens=5, temperature=0.7, seed=3, logprobs=True, ignore_eos=True)
    out = engine.generate(["one two"], sp)[0]
    ids = tok.encode("one two") + out.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / 0.7
    n = len(tok.encode("one two"))
    want = [logits[n - 1 + k].log_softmax(-1)[t].item() for k, t in enumerate(out.token_ids)]
    assert len(out.logprobs) == 5
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want), atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_n_samples_differ(engine):
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    a, b = engine.generate(PROMPTS[:2], sp), engine.generate(PROMPTS[:2], sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [(o.prompt_index, o.sample_index) for o in a] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert len({tuple(o.token_ids) for o in a[:3]}) > 1, "the n samples of one prompt should differ"
    # Sample j uses seed + j whatever the batch: sample 1 of seed 7 is sample 0 of seed 8.
    c = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, temperature=1.0, seed=8, ignore_eos=True))
    assert c[0].token_ids == a[1].token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    for sp in (SamplingParams(max_new_tokens=4, temperature=1.5, top_k=1, seed=0, ignore_eos=True),
               SamplingParams(max_new_tokens=4, temperature=1.5, top_p=1e-6, seed=0, ignore_eos=True)):
        assert [o.token_ids for o in engine.generate(PROMPTS[:2], sp)] == [o.token_ids for o in greedy]


def test_top_k_restricts_the_support(engine, model, tok):
    sp = SamplingParams(max_new_tokens=1, temperature=5.0, top_k=3, seed=0, n=12, ignore_eos=True)
    outs = engine.generate(["the"], sp)
    with torch.no_grad():
        top3 = model(torch.tensor([tok.encode("the")])).logits[0, -1].topk(3).indices.tolist()
    assert {o.token_ids[0] for o in outs} <= set(top3)
    assert len({o.token_ids[0] for o in outs}) > 1


def test_stop_token_ids_and_stop_strings(engine):
    free = engine.generate(["one two"], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = engine.generate(["one two"], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    piece = free.text[len(free.text) // 2:][:2]
    assert piece
    out = engine.generate(["one two"], SamplingParams(max_new_tokens=10, temperature=0, stop=(piece,)))[0]
    assert out.finish_reason == "stop" and piece not in out.text and free.text.startswith(out.text)


def test_eos_ends_a_sample(model, tok):
    class EosAfterTwo(torch.nn.Module):  # wraps the model; forces EOS on the third step
        def __init__(self):
            super().__init__()
            self.inner, self.calls = model, 0

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, **kw):
            out = self.inner(**kw)
            self.calls += 1
            if self.calls == 3:
                out.logits[:, -1, tok.eos_token_id] = 1e4
            return out

    out = TorchRollout(EosAfterTwo(), tok).generate(["one"], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert out.token_ids[-1] == tok.eos_token_id and len(out.token_ids) == 3 and out.finish_reason == "stop"


def test_chat_messages_use_the_template(engine, tok):
    msgs = [{"role": "user", "content": "2 + 2 ?"}]
    out = engine.generate([msgs], SamplingParams(max_new_tokens=2, temperature=0))[0]
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                              add_special_tokens=False)


def test_device_map_auto_model_is_respected(tmp_path, model, tok):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    model.save_pretrained(tmp_path / "m")
    # A small memory budget makes accelerate split the model (embeddings in memory, the rest offloaded),
    # the CPU-only stand-in for a model spread over several GPUs.
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="auto", max_memory={"cpu": "200KB"},
                                                offload_folder=str(tmp_path / "off"), dtype=torch.float32)
    assert len(set(auto.hf_device_map.values())) > 1
    devices = {n: p.device for n, p in auto.named_parameters()}
    eng = TorchRollout(auto, tok)
    assert eng.device_map == auto.hf_device_map
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == \
           [o.token_ids for o in TorchRollout(model, tok).generate(PROMPTS, sp)]
    assert devices == {n: p.device for n, p in auto.named_parameters()}, "the engine moved the model"
    with pytest.raises(VerlRuntimeError, match="offloaded to disk"):
        eng.update_weights(model.state_dict().items())


def test_update_weights_changes_generation_and_unknown_names_fail(tok):
    m = tiny_model(tokenizer=tok, seed=1, **SHAPE)
    other = tiny_model(tokenizer=tok, seed=2, **SHAPE)
    eng = TorchRollout(m, tok)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    assert eng.update_weights(iter(other.state_dict().items())) == len(other.state_dict())
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == \
           [o.token_ids for o in TorchRollout(other, tok).generate(PROMPTS, sp)]
    with pytest.raises(VerlRuntimeError, match="no weight named 'model.layers.0.self_attn.qkv_proj.weight'"):
        eng.update_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))])
    assert "model.norm.weight" in eng.weight_names()


@pytest.mark.parametrize("engine_cls", ["torch", "hf"])
def test_a_bad_push_names_the_weight_and_both_shapes_and_changes_nothing(tok, engine_cls):
    from verl.rollout.hf_engine import HFRollout
    cls = TorchRollout if engine_cls == "torch" else HFRollout
    m = tiny_model(tokenizer=tok, seed=1, **SHAPE)
    other = tiny_model(tokenizer=tok, seed=2, **SHAPE)
    eng = cls(m, tok)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    good = list(other.state_dict().items())
    shape_bad = good[:3] + [("model.norm.weight", torch.zeros(3))] + good[3:]
    with pytest.raises(VerlRuntimeError, match=r"'model.norm.weight' arrived as \(3,\) torch.float32 but .* holds "
                                               r"\(64,\) torch.float32"):
        eng.update_weights(iter(shape_bad))
    dtype_bad = [(k, v.double()) if k == "model.norm.weight" else (k, v) for k, v in good]
    with pytest.raises(VerlRuntimeError, match="torch.float64 but .* holds .* torch.float32"):
        eng.update_weights(iter(dtype_bad))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())   # the previous weights, intact
    assert eng.update_weights(iter(good)) == len(good)                       # a correct push still works
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == \
           [o.token_ids for o in TorchRollout(other, tok).generate(PROMPTS, sp)]


def test_release_and_resume(tok):
    m = tiny_model(tokenizer=tok, **SHAPE)
    eng = TorchRollout(m, tok, RolloutConfig(cpu_offload=True))
    sp = SamplingParams(max_new_tokens=4, temperature=0)
    before = eng.generate(PROMPTS, sp)
    eng.release()
    with pytest.raises(VerlRuntimeError, match="call resume"):
        eng.generate(PROMPTS, sp)
    eng.resume()
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == [o.token_ids for o in before]


def test_engine_failures_are_verl_runtime_errors(tok):
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **kw):
            raise ValueError("kernel exploded")

    with pytest.raises(VerlRuntimeError, match="torch rollout engine failed in generate: ValueError: kernel") as e:
        TorchRollout(Broken(), tok).generate(["one"], SamplingParams(max_new_tokens=2))
    assert isinstance(e.value.__cause__, ValueError)


def test_configuration_errors():
    with pytest.raises(VerlConfigError, match="did you mean 'vllm'"):
        RolloutConfig(engine="vlm")
    with pytest.raises(VerlConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(VerlConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(VerlConfigError, match="needs `model=`"):
        build_rollout(RolloutConfig(engine="torch"))
    with pytest.raises(VerlConfigError, match="rollout.tp=2 with rollout.engine=torch"):
        RolloutConfig(engine="torch", tp=2)


def test_engine_switch_is_one_config_value(model, tok, tmp_path):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    eng = build_rollout(RolloutConfig(engine="torch"), model_path=str(tmp_path))
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == \
           [o.token_ids for o in TorchRollout(model, tok).generate(PROMPTS, sp)]


def test_sglang_adapter_explains_why_it_cannot_run():
    from verl.rollout.sglang_engine import sglang_available
    ok, why = sglang_available()
    if ok:
        pytest.skip(HARDWARE + "a CUDA GPU with SGLang is here, so nothing refuses (tests/rollout/test_sglang_engine.py)")
    assert "sglang" in why.lower()
    with pytest.raises(VerlConfigError, match="rollout.engine=sglang cannot run here"):
        build_rollout(RolloutConfig(engine="sglang"), model_path="/nonexistent")


def test_greedy_logprobs_are_finite_and_negative(engine):
    out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=0, logprobs=True))
    assert all(math.isfinite(x) and x <= 0 for o in out for x in o.logprobs)


def test_max_model_len_caps_every_sample_and_refuses_prompts_that_leave_no_room(model, tok):
    eng = TorchRollout(model, tok, RolloutConfig(max_model_len=8))
    outs = eng.generate([[5, 6, 7], [5, 6, 7, 8, 9, 10]], SamplingParams(max_new_tokens=10, temperature=0,
                                                                         ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 2]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    with pytest.raises(VerlConfigError, match="8 tokens, which leaves no room to generate within max_model_len=8"):
        eng.generate([list(range(5, 13))], SamplingParams(max_new_tokens=2))
    default = TorchRollout(model, tok)
    assert default.max_model_len == model.config.max_position_embeddings


@pytest.mark.parametrize("greedy", [True, False])
def test_hf_generate_engine_behind_the_same_interface(model, tok, greedy):
    from verl.rollout.hf_engine import HFRollout
    sp = SamplingParams(max_new_tokens=6, temperature=0 if greedy else 0.9, seed=3, logprobs=True, n=2,
                        ignore_eos=True)
    hf = HFRollout(model, tok, RolloutConfig(engine="hf", max_batch_size=3))
    outs = hf.generate(PROMPTS, sp)
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(4) for j in range(2)]
    assert all(len(o.token_ids) == 6 and len(o.logprobs) == 6 and o.finish_reason == "length" for o in outs)
    assert all(math.isfinite(x) and x <= 0 for o in outs for x in o.logprobs)
    if greedy:  # transformers' greedy decoding and the torch engine's agree token for token
        ref = TorchRollout(model, tok).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for a, b in zip(outs, ref):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    else:  # seeded: the same call gives the same samples
        assert [o.token_ids for o in hf.generate(PROMPTS, sp)] == [o.token_ids for o in outs]


def test_hf_engine_stops_at_eos_and_stop_strings(model, tok):
    from verl.rollout.hf_engine import HFRollout
    hf = HFRollout(model, tok, RolloutConfig(engine="hf"))
    first = hf.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0]
    stop_at = first.token_ids[2]
    out = hf.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1] and out.finish_reason == "stop"


def _exponential_race(probs, generators):
    """The sampling convention as written (verl.rollout.base): q ~ Exp(1) by `exponential_`, argmax(p / q)."""
    q = torch.empty(probs.shape, dtype=torch.float64)
    for i, g in enumerate(generators):
        q[i].exponential_(generator=g)
    return (q.reciprocal_() * probs).argmax(-1)


def test_cpu_race_samples_what_the_exponential_draws_give_and_leaves_the_generators_alike():
    """sample_tokens on CPU draws uniforms and takes the logarithm only where a token can still win: every token
    and every generator state afterwards equal the plain `exponential_` race's (peaked, flat, masked rows, vocabularies
    of 5 to SmolLM2's 49152)."""
    from verl.rollout.torch_engine import _cpu_exponential_is_log1p, _race_cpu
    assert _cpu_exponential_is_log1p()  # this torch draws Exp(1) as -log1p(-u): the fast race is the one in use
    gen = torch.Generator().manual_seed(0)
    for trial, vocab in enumerate([5, 64, 1000, 49152] * 6):
        logits = torch.randn(6, vocab, generator=gen) * (trial % 5)  # scale 0: every row flat, all ties in p
        if trial % 3 == 0:
            logits[:, vocab // 2:] = float("-inf")  # top-k/top-p filtered tokens: p = 0
        probs = logits.softmax(-1)
        ours = [torch.Generator().manual_seed(7 * trial + r) for r in range(6)]
        plain = [torch.Generator().manual_seed(7 * trial + r) for r in range(6)]
        assert torch.equal(_race_cpu(probs, ours), _exponential_race(probs, plain)), f"trial {trial}, vocab {vocab}"
        for a, b in zip(ours, plain):
            assert torch.equal(a.get_state(), b.get_state())


def test_cpu_race_keeps_argmax_semantics_at_zero_draws_and_nan():
    """u = 0 (q = 0: an infinite score, or NaN where p = 0) and NaN probabilities give what the formula's argmax
    gives (the first maximum; NaN above everything, the first NaN)."""
    import math
    from verl.rollout.torch_engine import _race
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.5, 0.0], [0.25, float("nan"), 0.25, float("nan")],
                          [0.0, 0.0, 1.0, 0.0], [0.4, 0.1, 0.4, 0.1]])
    u = torch.tensor([[0.5, 0.0, 0.2, 0.0], [0.0, 0.3, 0.3, 0.9], [0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.0, 0.0],
                      [0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    q = torch.tensor([[-math.log1p(-x) for x in row] for row in u.tolist()], dtype=torch.float64)
    want = (q.reciprocal() * probs).argmax(-1)
    # two infinite scores (the first wins); p = u = 0 is NaN, which wins; a NaN probability; NaN beats inf; ties
    assert want.tolist() == [1, 0, 1, 3, 0]
    assert torch.equal(_race(probs, u), want)
