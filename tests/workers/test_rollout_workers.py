"""The rollout worker over verl.rollout's engines (hf, torch): prompt rows → the training batch (layout, EOS
masking, groups, rollout log-probs), prompts encoded by the engine's tokenizer alone, and weight sync from an
actor that does not share the module."""

from __future__ import annotations

import pytest
import torch

from verl.config import TinyModelConfig
from verl.data import task_corpus
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.rollout import RolloutConfig, build_rollout
from verl.models.tiny import tiny_model, tiny_tokenizer
from verl.workers import ActorWorker, RolloutWorker, TorchEngine
from verl.config import ActorConfig

SHAPE = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"}, {"prompt": "9+9=", "answer": "18"}]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(task_corpus("arithmetic"), 64)


def _worker(model, tok, **cfg):
    cfg = RolloutConfig(**cfg)
    return RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16)


@pytest.mark.parametrize("engine", ["hf", "torch"])
def test_batch_layout(engine, tok):
    model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=1)
    r = _worker(model, tok, engine=engine, n=4, max_new_tokens=6)
    b = r.generate(ROWS, seed=0)
    assert b.input_ids.shape[0] == 12 and b.response_mask.shape == (12, 6)
    assert b.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and b.answers[4] == "7"
    assert b.rollout_log_probs.shape == (12, 6)
    assert (b.rollout_log_probs <= 0).all() and (b.rollout_log_probs * (1 - b.response_mask) == 0).all()
    P = b.prompt_length
    for i in range(12):
        resp, m = b.responses[i], b.response_mask[i].bool()
        n_valid = int(m.sum())
        assert m[:n_valid].all() and not m[n_valid:].any()            # a prefix of the response
        eos = (resp[:n_valid] == tok.eos_token_id).nonzero()
        assert len(eos) == 0 or int(eos[0]) == n_valid - 1           # ends at the first EOS, EOS included
        assert (resp[n_valid:] == tok.pad_token_id).all()
        assert torch.equal(b.attention_mask[i, P:].bool(), m)
        prompt = b.input_ids[i, :P][b.attention_mask[i, :P].bool()].tolist()
        assert prompt == r.tokenizer.encode_prompt(b.prompts[i])     # encoded in one place: the engine's tokenizer
    greedy = r.generate(ROWS[:1], n=2, greedy=True)
    assert torch.equal(greedy.responses[0], greedy.responses[1])
    fixed = _worker(model, tok, engine=engine, n=2, max_new_tokens=5, ignore_eos=True).generate(ROWS)
    assert fixed.response_mask.all()


def test_prompts_longer_than_the_limit_fail_naming_it(tok):
    r = _worker(tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=1), tok, n=1)
    r.max_prompt_length = 3
    with pytest.raises(VerlConfigError, match="longer than data.max_prompt_length=3"):
        r.generate(ROWS)


def test_seeded_calls_reproduce_and_fast_decoder_changes_the_path_not_the_samples(tok):
    model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=1)
    batches = {}
    for fast in (True, False):
        r = _worker(model, tok, n=3, max_new_tokens=6, decoder="fast" if fast else "model")
        assert (r.engine._fast is not None) == fast
        batches[fast] = r.generate(ROWS, seed=7)
    assert torch.equal(batches[True].input_ids, batches[False].input_ids)
    assert torch.equal(batches[True].response_mask, batches[False].response_mask)


@pytest.mark.parametrize("engine", ["hf", "torch"])
def test_sync_weights_shares_the_actor_module_or_moves_the_weights(engine, tok):
    placement = Placement()
    actor_model, rollout_model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=2), tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=1)
    kw = dict(temperature=1.0, responses_per_mini=3, max_response_length=4)
    actor = ActorWorker(TorchEngine(actor_model, None, placement), ActorConfig(), **kw)
    shared = _worker(actor_model, tok, engine=engine, n=1, max_new_tokens=4).sync_weights(actor)
    assert shared["perf/sync_shared"] == 1.0 and shared["perf/sync_s"] == 0.0
    separate = _worker(rollout_model, tok, engine=engine, n=1, max_new_tokens=4)
    metrics = separate.sync_weights(actor)
    assert metrics["perf/sync_shared"] == 0.0 and metrics["perf/sync_bytes"] > 0
    for k, v in rollout_model.state_dict().items():
        assert torch.equal(v, actor_model.state_dict()[k]), k       # bit-exact


@pytest.mark.parametrize("vocab", [None, 4100], ids=["lm-head-gemm", "fused-lm-head"])
def test_train_decoder_makes_the_rollout_train_mismatch_exactly_zero(tok, vocab):
    """decoder=train samples from the training forward itself: the rollout's log-probs equal the actor's
    log-prob pass bit for bit (fp32), across micro-batches, left padding and early EOS."""
    from dataclasses import replace
    from verl.algos import rollout_mismatch
    model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=4)
    if vocab is not None:  # a vocabulary large enough for the fused LM-head kernel
        model.resize_token_embeddings(vocab)
        torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.02)
    cfg = ActorConfig(micro_batch_size=4, padding_free=False)  # as the trainer sets it for decoder=train
    actor = ActorWorker(TorchEngine(model, None, Placement()), cfg, temperature=0.7, responses_per_mini=12,
                        max_response_length=6)
    rcfg = RolloutConfig(engine="torch", decoder="train", n=4, max_new_tokens=6, temperature=0.7,
                         max_batch_size=cfg.micro_batch_size)
    worker = RolloutWorker(build_rollout(rcfg, model=model, tokenizer=tok), rcfg, max_prompt_length=16)
    rows = ROWS + [{"prompt": "1+2+3+4=", "answer": "10"}]
    batch = worker.generate(rows, seed=11)
    assert len({int(m.sum()) for m in batch.response_mask}) > 1 or vocab is not None  # early EOS somewhere
    train_lp, _ = actor.compute_log_probs(batch)
    assert torch.equal(batch.rollout_log_probs, train_lp)
    assert rollout_mismatch(train_lp, batch.rollout_log_probs, batch.response_mask)["rollout/mismatch_max"] == 0.0
    # the default (KV-cache) decoder samples the same tokens here but its log-probs differ in the last bits
    fast = RolloutWorker(build_rollout(replace(rcfg, decoder="fast"), model=model, tokenizer=tok), rcfg,
                         max_prompt_length=16).generate(rows, seed=11)
    assert torch.equal(fast.input_ids, batch.input_ids)
    assert (fast.rollout_log_probs - train_lp).abs().max() < 1e-4


def _split_generation(rank, world_size):
    tok = tiny_tokenizer(task_corpus("arithmetic"), 64)
    model = tiny_model(SHAPE, tokenizer=tok, tie_word_embeddings=True, seed=1)
    cfg = RolloutConfig(n=2, max_new_tokens=5)
    # one training replica over both ranks (as megatron TP=2), generated as two replicas (rollout.tp=1)
    placement = Placement(rank=rank, world_size=2, tp_size=2, tp_rank=rank, dp_size=1, dp_rank=0)
    worker = RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16,
                           placement=placement)
    rows = ROWS + [{"prompt": "5+5=", "answer": "10"}]
    split = worker.generate(rows, seed=5)
    whole = RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16).generate(
        rows, seed=5)
    return split.input_ids, split.rollout_log_probs, whole.input_ids


@pytest.mark.multiprocess
def test_generation_replicas_split_the_prompts_and_every_rank_gets_its_training_batch():
    from verl.testing import run_distributed
    (ids0, lp0, whole0), (ids1, lp1, _) = run_distributed(_split_generation, 2, timeout=120)
    assert torch.equal(ids0, ids1) and torch.equal(lp0, lp1)     # the training replica's batch, on both ranks
    assert torch.equal(ids0, whole0)     # seeded by row: the split changes who samples, not what is sampled
