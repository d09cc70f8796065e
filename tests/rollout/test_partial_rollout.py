"""Partial rollouts on the torch engine: a pause hook that never changes the version changes nothing; one
that loads other weights mid-generation gives exactly the old model's tokens up to the switch and the new
model's greedy continuation after it (KV cache rebuilt on every decode path), with per-token versions; the
training batch carries those versions."""

from __future__ import annotations

import pytest
import torch

from verl.errors import VerlRuntimeError
from verl.rollout import GenerationOutput, RolloutConfig, SamplingParams, Tokenizer, TorchRollout, pausable_engines
from verl.models.tiny import tiny_model, tiny_tokenizer
from verl.workers.batch import RolloutBatch, batch_from_outputs

PROMPTS = ["the quick brown", "what", "one two three four five six"]
SHAPE = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2)
# fast: verl's static-cache decoder; model: the HF forward with its KV cache; no_cache: full recompute each
# step; train: the training forward over the whole buffer
PATHS = {"fast": dict(decoder="fast"), "model": dict(decoder="model"), "no_cache": dict(kv_cache=False),
         "train": dict(decoder="train")}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, seed: int):
    return tiny_model(tokenizer=tok, seed=seed, **SHAPE)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_hook_that_keeps_its_version_changes_nothing(tok, path):
    # one wave of all 6 rows on both sides (more rows than max_batch_size would decode continuously without a
    # hook and in waves with one: equal samples, log-probs equal only to rounding)
    engine = TorchRollout(_model(tok, 0), tok, RolloutConfig(max_batch_size=8, **PATHS[path]))
    # sampled, n > 1, rows stopping at different steps (so the fast decoder drops finished rows)
    sp = SamplingParams(max_new_tokens=12, n=2, temperature=0.9, seed=4, logprobs=True,
                        stop_token_ids=tuple(range(5, 25)))
    plain = engine.generate(PROMPTS, sp)
    engine.take_metrics()
    calls = []
    engine.pause_hook = lambda: calls.append(1) or 7
    hooked = engine.generate(PROMPTS, sp)
    assert len({len(o.token_ids) for o in plain}) > 1
    for a, b in zip(plain, hooked):
        assert a.token_versions is None
        assert b.token_ids == a.token_ids and b.logprobs == a.logprobs  # bit for bit
        assert b.token_versions == [7] * len(b.token_ids)
    assert len(calls) >= max(len(o.token_ids) for o in hooked)
    assert "rollout/partial_rebuilds" not in engine.take_metrics()


class _SwitchAt:
    """Returns version 0 for the first k tokens; before token k it loads `state` into the engine and returns 1."""

    def __init__(self, engine: TorchRollout, state: dict, k: int):
        self.engine, self.state, self.k, self.calls = engine, state, k, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls == self.k + 1:
            self.engine.update_weights(self.state.items())
        return 0 if self.calls <= self.k else 1


@torch.no_grad()
def _greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """A plain argmax loop over the model's full forward (no cache): the reference."""
    ids, toks, lps = list(ids), [], []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        t = int(logits.argmax())
        toks.append(t)
        lps.append(logits.log_softmax(-1)[t].item())
        ids.append(t)
    return toks, lps


@pytest.mark.parametrize("k", [0, 3, 6])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_weights_switched_mid_generation_continue_with_the_new_model(tok, path, k):
    """The longest prompt has the smallest budget (max_model_len), so its rows finish first: the fast decoder
    drops them before the switch at k=6, the other paths carry them as masked columns through the rebuild."""
    model_a, model_b = _model(tok, 0), _model(tok, 1)
    encoded = [Tokenizer(tok).encode_prompt(p) for p in PROMPTS]
    longest = max(len(p) for p in encoded)
    engine = TorchRollout(model_a, tok, RolloutConfig(max_model_len=longest + 5, **PATHS[path]))
    engine.take_metrics()
    # the references first: the hook overwrites model_a's weights in place
    refs = []
    for p in encoded:
        budget = min(9, longest + 5 - len(p))
        a_toks, a_lps = _greedy(model_a, p, min(k, budget))
        b_toks, b_lps = _greedy(model_b, p + a_toks, budget - len(a_toks))
        refs.append((a_toks + b_toks, a_lps + b_lps, len(a_toks)))
    engine.pause_hook = _SwitchAt(engine, model_b.state_dict(), k)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=9, n=2, temperature=0, logprobs=True,
                                                   ignore_eos=True))
    assert len({len(o.token_ids) for o in outs}) > 1  # the budgets differ, so rows finish at different steps
    for o in outs:
        want_toks, want_lps, switched_at = refs[o.prompt_index]
        assert o.token_ids == want_toks
        assert o.token_versions == [0] * switched_at + [1] * (len(want_toks) - switched_at)
        torch.testing.assert_close(torch.tensor(o.logprobs[switched_at:]), torch.tensor(want_lps[switched_at:]),
                                   atol=1e-5, rtol=0)
    assert engine.take_metrics()["rollout/partial_rebuilds"] == 1.0


def test_update_weights_before_a_generation_needs_no_rebuild(tok):
    model_b = _model(tok, 1)
    engine = TorchRollout(_model(tok, 0), tok)
    engine.update_weights(model_b.state_dict().items())
    engine.pause_hook = lambda: 1
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    outs = engine.generate(PROMPTS, sp)
    assert "rollout/partial_rebuilds" not in engine.take_metrics()
    ref = TorchRollout(model_b, tok).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def _out(prompt: list[int], tokens: list[int], versions: list[int] | None) -> GenerationOutput:
    return GenerationOutput(prompt_index=0, sample_index=0, prompt_token_ids=prompt, token_ids=tokens, text="",
                            finish_reason="stop", token_versions=versions)


def test_batch_from_outputs_carries_token_versions_and_the_oldest_per_row():
    outs = [_out([5, 6], [7, 8, 9], [2, 2, 3]), _out([5], [7], [3]), _out([5, 6, 7], [], []),
            _out([5], [7, 8, 9, 10, 11], [1, 2, 2, 3, 3])]
    rows = [{"prompt": f"p{i}", "answer": ""} for i in range(4)]
    batch = batch_from_outputs(outs, rows, 1, response_length=4, pad_id=0)
    assert batch.token_version.tolist() == [[2, 2, 3, -1], [3, -1, -1, -1], [-1, -1, -1, -1], [1, 2, 2, 3]]
    assert batch.token_version.dtype == torch.long
    # the oldest real token; the empty response takes the newest version in the batch
    assert batch.weight_version.tolist() == [2, 3, 3, 1]
    picked = batch.select(torch.tensor([3, 0]))
    assert picked.token_version.tolist() == [[1, 2, 2, 3], [2, 2, 3, -1]]
    assert picked.weight_version.tolist() == [1, 2]
    assert batch[1:3].token_version.tolist() == [[3, -1, -1, -1], [-1, -1, -1, -1]]
    joined = RolloutBatch.concat([batch[2:], batch[:2]])
    assert joined.token_version.tolist() == batch.token_version[[2, 3, 0, 1]].tolist()
    assert joined.weight_version.tolist() == [3, 1, 2, 3]

    plain = batch_from_outputs([_out([5], [7], None), _out([5], [7], [0])], rows[:2], 1, 4, 0)
    assert plain.token_version is None and plain.weight_version is None
    assert RolloutBatch.concat([joined, plain]).token_version is None


def test_only_the_torch_engine_can_pause():
    assert pausable_engines() == ("torch",)


def test_a_hook_that_returns_no_version_is_named(tok):
    engine = TorchRollout(_model(tok, 0), tok)
    engine.pause_hook = lambda: None
    with pytest.raises(VerlRuntimeError, match=r"pause_hook returned None; it must return the weight version"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=0))
