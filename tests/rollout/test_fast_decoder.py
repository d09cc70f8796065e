"""verl's static-cache decoder reproduces the transformers forward of Llama-family models: prefill and every
decode step of a left-padded batch, grouped-query attention, q/k/v biases (Qwen2), tied and untied heads;
models it cannot reproduce are named and left on their own forward."""

from __future__ import annotations

import pytest
import torch

from verl.rollout import RolloutConfig, SamplingParams, TorchRollout
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


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_prefill_and_every_decode_step_match_the_transformers_forward(name):
    model = MODELS[name]()
    assert unsupported_reason(model) is None
    ids, mask = _left_padded([5, 9, 1, 7], 64)
    steps = 6
    dec = LlamaFamilyDecoder(model)
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
