"""Rollout workers (HF generate and verl.rollout's torch engine): batch layout, EOS masking, groups, and
weight sync from an actor that does not share the module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl.config import RolloutConfig, TinyModelConfig
from verl.data import task_corpus
from verl.testing.tiny import tiny_model, tiny_tokenizer
from verl.workers.rollout import HFRollout

SHAPE = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"}, {"prompt": "9+9=", "answer": "18"}]


def _policy(tok, seed):
    return tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=seed)


def _engines():
    out = [pytest.param(HFRollout, id="hf")]
    try:
        from verl.workers.torch_rollout import TorchEngineRollout
        import verl.rollout  # noqa: F401
        out.append(pytest.param(TorchEngineRollout, id="torch"))
    except ImportError:
        pass
    return out


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(task_corpus("arithmetic"), 64)


@pytest.mark.parametrize("engine", _engines())
def test_batch_layout(engine, tok):
    model = _policy(tok, seed=1)
    torch.manual_seed(0)
    r = engine(model, tok, RolloutConfig(n=4, max_new_tokens=6), 16, torch.device("cpu"))
    b = r.generate(ROWS)
    assert b.input_ids.shape[0] == 12 and b.response_mask.shape == (12, 6)
    assert b.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and b.answers[4] == "7"
    P = b.prompt_length
    for i in range(12):
        resp, m = b.responses[i], b.response_mask[i].bool()
        n_valid = int(m.sum())
        assert m[:n_valid].all() and not m[n_valid:].any()            # a prefix of the response
        eos = (resp[:n_valid] == tok.eos_token_id).nonzero()
        assert len(eos) == 0 or int(eos[0]) == n_valid - 1           # ends at the first EOS, EOS included
        assert (resp[n_valid:] == tok.pad_token_id).all()
        assert torch.equal(b.attention_mask[i, P:].bool(), m)
    greedy = r.generate(ROWS[:1], n=2, greedy=True)
    assert torch.equal(greedy.responses[0], greedy.responses[1])
    fixed = engine(model, tok, RolloutConfig(n=2, max_new_tokens=5, ignore_eos=True), 16,
                   torch.device("cpu")).generate(ROWS)
    assert fixed.response_mask.all()


@pytest.mark.parametrize("engine", _engines())
def test_sync_weights_from_a_separate_actor(engine, tok):
    rollout_model, actor_model = _policy(tok, seed=1), _policy(tok, seed=2)
    r = engine(rollout_model, tok, RolloutConfig(n=1, max_new_tokens=3), 16, torch.device("cpu"))
    shared = SimpleNamespace(engine=SimpleNamespace(module=rollout_model))
    assert r.sync_weights(shared) == 0
    weights = {k: v.clone() for k, v in actor_model.state_dict().items() if k != "lm_head.weight"}
    separate = SimpleNamespace(engine=SimpleNamespace(), hf_weights=lambda: weights)
    assert r.sync_weights(separate) > 0
    for k, v in rollout_model.state_dict().items():
        torch.testing.assert_close(v, actor_model.state_dict()[k])
def test_fast_decoder_setting_changes_the_path_not_the_samples(tok):
    pytest.importorskip("verl.rollout")
    from verl.workers.torch_rollout import TorchEngineRollout
    model = _policy(tok, seed=1)
    batches = {}
    for fast in (True, False):
        r = TorchEngineRollout(model, tok, RolloutConfig(n=3, max_new_tokens=6, fast_decoder=fast), 16,
                               torch.device("cpu"))
        assert (r.engine._fast is not None) == fast
        torch.manual_seed(7)
        batches[fast] = r.generate(ROWS)
    assert torch.equal(batches[True].input_ids, batches[False].input_ids)
    assert torch.equal(batches[True].response_mask, batches[False].response_mask)
