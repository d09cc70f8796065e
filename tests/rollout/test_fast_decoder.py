"""verl's static-cache decoder reproduces the transformers forward of Llama-family models: prefill and every
decode step of a left-padded batch, grouped-query attention, q/k/v biases (Qwen2), tied and untied heads;
models it cannot reproduce are named and left on their own forward."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import needs_ext
from verl import _extension
from verl.ops.attention import decode_attention
from verl.rollout import RolloutConfig, SamplingParams, TorchRollout, fast_decoder
from verl.rollout.fast_decoder import LlamaFamilyDecoder, unsupported_reason
from verl.models.tiny import tiny_model, tiny_tokenizer


def _qwen2(vocab: int, **extra):
    # Qwen2 initialises its q/k/v biases at zero (and norms at one): noise makes them count.
    return tiny_model(family="qwen2", vocab_size=vocab, intermediate_size=96, max_position_embeddings=256,
                      initializer_range=0.2, noise=0.3, **extra).eval()


MODELS = {
    "llama-gqa": lambda: tiny_model(vocab_size=64, intermediate_size=96, initializer_range=0.2).eval(),
    "llama-mha-tied": lambda: tiny_model(vocab_size=64, num_heads=2, num_kv_heads=2, intermediate_size=80,
                                         tie_word_embeddings=True, initializer_range=0.2, seed=3).eval(),
    "qwen2-bias": lambda: _qwen2(64),
}


def _left_padded(lengths: list[int], vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, P - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, P - n:] = 1
    return ids, mask


def _hf_last_logits(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]


@pytest.mark.parametrize("fused_attention", [True, False], ids=["verl-attention", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_prefill_and_every_decode_step_match_the_transformers_forward(name, fused_attention, monkeypatch):
    """Decode steps attend through verl.ops.decode_attention by default (where verl._C is built), or SDPA."""
    model = MODELS[name]()
    assert unsupported_reason(model) is None
    ids, mask = _left_padded([5, 9, 1, 7], 64)
    steps = 6
    dec = LlamaFamilyDecoder(model)
    dec.fused_attention = fused_attention
    calls = []
    monkeypatch.setattr(fast_decoder, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a))
    dec.start(len(ids), ids.shape[1] + steps)
    logits = dec.step(ids, mask)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        torch.testing.assert_close(logits, _hf_last_logits(model, ids, mask), atol=1e-5, rtol=1e-5,
                                   msg=f"{name}: step {s}")
        nxt = torch.randint(3, 64, (len(ids), 1), generator=g)
        live = torch.tensor([1, 1, 0 if s >= 2 else 1, 1])  # row 2 finishes after two steps (masked from then on)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, live[:, None]], 1)
        logits = dec.step(nxt, mask)
    n_layers = len(model.model.layers)
    assert len(calls) == (steps * n_layers if fused_attention and _extension.available() else 0)


@torch.no_grad()
def test_weights_changed_after_start_are_seen_by_the_next_start():
    model = MODELS["llama-gqa"]()
    ids, mask = _left_padded([4, 6], 64)
    dec = LlamaFamilyDecoder(model)
    dec.start(2, 8)
    before = dec.step(ids, mask)
    model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # what an optimizer step does between rollouts
    dec.start(2, 8)
    after = dec.step(ids, mask)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, _hf_last_logits(model, ids, mask), atol=1e-5, rtol=1e-5)


def test_running_past_max_len_is_an_error_naming_the_limit():
    model = MODELS["llama-gqa"]()
    ids, mask = _left_padded([3], 64)
    dec = LlamaFamilyDecoder(model)
    dec.start(1, 3)
    dec.step(ids, mask)
    with pytest.raises(ValueError, match="max_len 3"):
        dec.step(ids[:, :1], torch.cat([mask, mask[:, :1]], 1))


def test_finish_frees_the_cache_and_step_needs_start():
    model = MODELS["llama-gqa"]()
    ids, mask = _left_padded([3, 2], 64)
    dec = LlamaFamilyDecoder(model)
    with pytest.raises(ValueError, match="before start"):
        dec.step(ids, mask)
    dec.start(2, 6)
    dec.step(ids, mask)
    dec.finish()
    assert dec.layers == [] and dec.cos is None
    tok = tiny_tokenizer()
    engine = TorchRollout(tiny_model(tokenizer=tok, intermediate_size=96, initializer_range=0.2), tok)
    engine.generate(["what"], SamplingParams(max_new_tokens=3, temperature=0))
    assert engine._fast.layers == []  # nothing of the rollout's KV cache outlives generate()


def test_unsupported_models_are_named_and_keep_their_own_forward():
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="cannot run this model"):
        LlamaFamilyDecoder(gpt2)
    windowed = _qwen2(64, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert unsupported_reason(windowed) == "sliding-window attention"
    tok = tiny_tokenizer()
    assert TorchRollout(windowed, tok)._fast is None
    assert TorchRollout(MODELS["llama-gqa"](), tok)._fast is not None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_output_is_the_same_with_and_without_the_fast_decoder(temperature):
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, intermediate_size=96, initializer_range=0.2)
    sp = SamplingParams(max_new_tokens=8, n=2, temperature=temperature, seed=5, logprobs=True, ignore_eos=True)
    prompts = ["the quick brown", "what", "one two three four five six"]
    fast = TorchRollout(model, tok, RolloutConfig(decoder="fast")).generate(prompts, sp)
    slow = TorchRollout(model, tok, RolloutConfig(decoder="model")).generate(prompts, sp)
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@torch.no_grad()
def test_selected_rows_decode_as_if_prefilled_alone():
    """select() repeats a prefilled row (a group's shared prompt) and drops rows (finished ones): the next
    steps match the transformers forward on exactly those rows."""
    model = MODELS["llama-gqa"]()
    ids, mask = _left_padded([5, 3], 64)
    dec = LlamaFamilyDecoder(model)
    dec.start(2, ids.shape[1] + 4)
    dec.step(ids, mask)
    rows = torch.tensor([1, 0, 1])  # row 1 twice: one prompt, two samples
    dec.select(rows)
    ids, mask = ids[rows], mask[rows]
    nxt = torch.tensor([[7], [9], [11]])
    ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    torch.testing.assert_close(dec.step(nxt, mask), _hf_last_logits(model, ids, mask), atol=1e-5, rtol=1e-5)
    keep = torch.tensor([2, 0])  # the middle row finished
    dec.select(keep)
    ids, mask = ids[keep], mask[keep]
    nxt = torch.tensor([[5], [6]])
    ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    torch.testing.assert_close(dec.step(nxt, mask), _hf_last_logits(model, ids, mask), atol=1e-5, rtol=1e-5)


def test_rows_that_stop_early_leave_the_batch_with_the_same_samples():
    """EOS-terminated rows of different lengths: the fast decoder (shared prefill, finished rows dropped)
    samples exactly what the model's own forward (every row to the end) samples, and computes fewer padded
    positions."""
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, intermediate_size=96, initializer_range=0.2)
    sp = SamplingParams(max_new_tokens=24, n=4, temperature=1.0, seed=3, logprobs=True,
                        stop_token_ids=list(range(5, 25)))  # a third of the vocabulary stops a row
    prompts = ["the quick brown", "what", "one two three four five six"]
    fast_engine = TorchRollout(model, tok, RolloutConfig(decoder="fast"))
    slow_engine = TorchRollout(model, tok, RolloutConfig(decoder="model"))
    fast, slow = fast_engine.generate(prompts, sp), slow_engine.generate(prompts, sp)
    lengths = [len(o.token_ids) for o in slow]
    assert len(set(lengths)) > 3 and max(lengths) < 24  # rows stop at EOS at many different steps
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    fast_share = fast_engine.take_metrics()["rollout/padded_share"]
    slow_share = slow_engine.take_metrics()["rollout/padded_share"]
    assert 0 <= fast_share < slow_share
    assert fast_engine.take_metrics() == {}  # the count restarts after each read


@torch.no_grad()
def test_rows_joining_a_running_batch_decode_as_they_would_alone():
    """Continuous batching (multi-turn rollouts): a row that joins a batch mid-decode, and the row it joins, get the
    logits they get decoded alone; so does the joined row after the first one leaves and the columns nobody uses
    any more are trimmed."""
    model = tiny_model(seed=4, noise=0.1).eval()
    dec = LlamaFamilyDecoder(model)

    def alone(prompt: list[int], feed: list[int]) -> list[torch.Tensor]:
        dec.start(1, 32)
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = [dec.step(torch.tensor([prompt]), mask)]
        for t in feed:
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1)
            out.append(dec.step(torch.tensor([[t]]), mask))
        return out
    ones = lambda n: torch.ones(1, n, dtype=torch.long)  # noqa: E731
    a, b = [5, 6, 7, 8, 9, 10, 11], [12, 13]
    want_a, want_b = alone(a, [20, 21, 22]), alone(b, [30, 31, 32])
    dec.prepare(1)
    got_a, mask = [dec.join(torch.tensor([a]), ones(len(a)), 8)], ones(len(a))
    for t in (20, 21):
        mask = torch.cat([mask, ones(1)], 1)
        got_a.append(dec.step(torch.tensor([[t]]), mask))
    got_b = [dec.join(torch.tensor([b]), ones(len(b)), 8)]  # joins at column 9, right-aligned
    mask = torch.cat([mask, torch.cat([torch.zeros(1, mask.shape[1] - len(b), dtype=torch.long), ones(len(b))], 1)])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    both = dec.step(torch.tensor([[22], [30]]), mask)
    got_a.append(both[:1])
    got_b.append(both[1:])
    dec.select(torch.tensor([1]))  # a is done
    mask = mask[1:]
    first = int(mask.argmax(-1).min())
    assert first == 7
    dec.trim(first)
    mask = mask[:, first:]
    for t in (31, 32):
        mask = torch.cat([mask, ones(1)], 1)
        got_b.append(dec.step(torch.tensor([[t]]), mask))
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_int8_decoder_is_the_forward_with_int8_weights(name):
    """quantization=int8: every projection and the head run in int8 (counted), and the logits are exactly the
    transformers forward of the same model with its linear weights replaced by their dequantized int8 copies;
    the float32 model's logits are near, not equal (the rounding is real)."""
    import copy

    from verl.ops.quant import quantize_int8
    model = MODELS[name]()
    ids, mask = _left_padded([5, 9, 1, 7], 64)
    dec = LlamaFamilyDecoder(model, quantization="int8")
    dec.start(len(ids), ids.shape[1] + 2)
    logits = dec.step(ids, mask)
    assert dec.quantized == 4 * len(model.model.layers) + 1 and dec.unquantized == {}
    rounded = copy.deepcopy(model)
    # a tied head is quantized as the head only: the embedding lookup keeps the float32 table
    rounded.lm_head.weight = torch.nn.Parameter(rounded.lm_head.weight.clone())
    for mod in rounded.modules():
        if isinstance(mod, torch.nn.Linear):
            q, s = quantize_int8(mod.weight)
            mod.weight.copy_(q.float() * s[:, None])
    torch.testing.assert_close(logits, _hf_last_logits(rounded, ids, mask), atol=2e-4, rtol=1e-4)
    full = _hf_last_logits(model, ids, mask)
    assert 0 < float((logits - full).abs().max()) < 0.1 * float(full.abs().max())
    nxt = torch.randint(3, 64, (len(ids), 1), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=torch.long)], 1)
    torch.testing.assert_close(dec.step(nxt, mask), _hf_last_logits(rounded, torch.cat([ids, nxt], 1), mask),
                               atol=2e-4, rtol=1e-4)


def test_int8_layers_the_kernel_cannot_serve_stay_as_they_are_named_and_counted(caplog):
    """A bfloat16 model: no projection can run in the float32 int8 kernel; each is named with the reason, counted
    in rollout/unquantized_layers, and the engine generates on (in bfloat16)."""
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, intermediate_size=96, initializer_range=0.2).to(torch.bfloat16)
    engine = TorchRollout(model, tok, RolloutConfig(quantization="int8"))
    with caplog.at_level("WARNING", logger="verl.rollout.torch_engine"):
        out = engine.generate(["the quick brown"], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
        metrics = engine.take_metrics()
    assert len(out[0].token_ids) == 3
    layers = 4 * len(model.model.layers) + 1
    assert metrics["rollout/quantized_layers"] == 0 and metrics["rollout/unquantized_layers"] == layers
    assert "model.layers.0.self_attn.qkv_proj: torch.bfloat16 weights" in caplog.text
    assert f"{layers} projection(s) stay unquantized" in caplog.text
    # a model the fast decoder does not run keeps every linear layer in its own dtype, said once at start-up
    windowed = _qwen2(64, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with caplog.at_level("WARNING", logger="verl.rollout.torch_engine"):
        eng = TorchRollout(windowed, tok, RolloutConfig(quantization="int8"))
    assert eng._fast is None and "sliding-window attention" in caplog.text
    assert eng.take_metrics()["rollout/unquantized_layers"] > 0


def test_int8_is_refused_where_it_cannot_run():
    from verl.errors import VerlConfigError
    with pytest.raises(VerlConfigError, match="rollout.quantization=int8 with rollout.engine=hf.*one of \\['torch'\\]"):
        RolloutConfig(engine="hf", quantization="int8")
    with pytest.raises(VerlConfigError, match="rollout.decoder=model"):
        RolloutConfig(quantization="int8", decoder="model")
    with pytest.raises(VerlConfigError, match="quantization"):
        RolloutConfig(quantization="fp4")


@pytest.mark.parametrize("stop", [(), ("e",)])
def test_more_rows_than_the_batch_decode_continuously_with_the_same_samples(stop):
    """rollout.max_batch_size below the number of rows: the fast decoder batches continuously (finished rows' slots
    are taken by pending ones, a group's samples prefilled once) and samples exactly what the model's own forward
    samples in waves of max_batch_size rows: the same tokens, log-probs, finish reasons and stop-string cuts."""
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, intermediate_size=96, initializer_range=0.2)
    sp = SamplingParams(max_new_tokens=20, n=3, temperature=1.0, seed=11, logprobs=True,
                        stop_token_ids=list(range(5, 20)), stop=list(stop))
    prompts = ["the quick brown", "what", "one two three four five six", "a b", "seven", "x y z"]
    cfg = dict(max_batch_size=4)
    fast_engine = TorchRollout(model, tok, RolloutConfig(decoder="fast", **cfg))
    fast = fast_engine.generate(prompts, sp)
    slow = TorchRollout(model, tok, RolloutConfig(decoder="model", **cfg)).generate(prompts, sp)
    assert len(set(len(o.token_ids) for o in slow)) > 3  # rows finish at many different steps
    ends = set(sp.stop_token_ids) | {tok.eos_token_id}
    by_string = [o for o in slow if o.finish_reason == "stop" and o.token_ids[-1] not in ends]
    assert bool(by_string) == bool(stop)  # the stop string ends rows (not only the stop ids)
    for a, b in zip(fast, slow):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    metrics = fast_engine.take_metrics()
    assert metrics["rollout/continuous_joins"] >= 2  # pending rows joined a running batch, more than once
    assert fast_engine._fast.rows == 0  # the cache went back


def test_generate_with_fewer_rows_than_the_batch_runs_one_wave():
    tok = tiny_tokenizer()
    engine = TorchRollout(tiny_model(tokenizer=tok), tok, RolloutConfig(decoder="fast", max_batch_size=8))
    engine.generate(["the quick brown", "what"], SamplingParams(max_new_tokens=4, n=4, seed=1))
    assert "rollout/continuous_joins" not in engine.take_metrics()


@torch.no_grad()
@pytest.mark.parametrize("pack", [pytest.param("verl", marks=needs_ext), "onednn", "mkl"])
def test_float32_projections_run_packed_and_compute_what_f_linear_computes(pack):
    """Every float32 projection and the head are packed at start (verl._C is built; this torch has oneDNN and
    MKL); a packed projection gives F.linear's result (MKL bit for bit at 16 rows or more, verl's and oneDNN within
    rounding) and verl's and oneDNN give the same row whatever the batch's row count (from 1 row) and thread count;
    pack="none" keeps F.linear; all decoders give the same logits."""
    import torch.nn.functional as F
    model = MODELS["qwen2-bias"]()
    # "auto" takes verl's where the extension is built, else oneDNN where torch has it
    assert LlamaFamilyDecoder(model).packing == ("verl" if _extension.available() else "onednn")
    dec = LlamaFamilyDecoder(model, pack=pack)
    assert dec.pack_unavailable is None and dec.packing == pack
    ids, mask = _left_padded([5, 9, 1, 7], 64)
    dec.start(len(ids), ids.shape[1] + 2)
    assert dec.packed == 4 * len(model.model.layers) + 1
    attn = model.model.layers[0].self_attn
    qkv = dec.layers[0]["qkv"]
    assert qkv.packed is not None and qkv.mode == pack
    weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    x = torch.randn(24, weight.shape[1], generator=torch.Generator().manual_seed(0))
    out = qkv(x)
    if pack == "mkl":
        assert torch.equal(out, F.linear(x, weight, bias))
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    for rows in range(16 if pack == "mkl" else 1, 24):
        assert torch.equal(qkv(x[:rows]), out[:rows]), rows
    if pack != "mkl":
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(qkv(x), out)
        finally:
            torch.set_num_threads(threads)
    plain = LlamaFamilyDecoder(model, pack="none")
    plain.start(len(ids), ids.shape[1] + 2)
    assert plain.packed == 0 and plain.layers[0]["qkv"].packed is None
    torch.testing.assert_close(dec.step(ids, mask), plain.step(ids, mask), atol=1e-5, rtol=1e-5)


def test_clear_unknown_packing_names_the_choices():
    with pytest.raises(ValueError, match=r"pack='fast' is not one of \('auto', 'verl', 'onednn', 'mkl', 'none'\)"):
        LlamaFamilyDecoder(MODELS["qwen2-bias"](), pack="fast")
