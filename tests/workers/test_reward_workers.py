"""Reward workers: a model-based reward model scores prompt + response; rule-based scores are checked."""

from __future__ import annotations

import pytest
import torch

from verl.data import task_corpus
from verl.errors import VerlConfigError
from verl.testing.tiny import save_tiny, tiny_model, tiny_tokenizer
from verl.workers import ModelRewardWorker, RolloutBatch, RuleRewardWorker


def _batch(texts, answers):
    n = len(texts)
    z = torch.zeros(n, 2, dtype=torch.long)
    return RolloutBatch(input_ids=z, attention_mask=z, position_ids=z, response_mask=torch.ones(n, 1),
                        group=torch.arange(n), prompts=["1+1="] * n, answers=answers, response_texts=texts)


def test_model_reward_scores_with_the_classification_head(tmp_path):
    tok = tiny_tokenizer(task_corpus("arithmetic"), 64)
    rm = tiny_model(head="score", tokenizer=tok, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1)
    save_tiny(rm, tok, tmp_path)
    worker = ModelRewardWorker(str(tmp_path), torch.device("cpu"))
    batch = _batch(["2", "3", "12"], ["2", "2", "2"])
    scores = worker.score(batch)
    enc = tok(["1+1=2", "1+1=3", "1+1=12"], return_tensors="pt", padding=True, padding_side="right")
    torch.testing.assert_close(scores, rm(**enc).logits[:, 0].detach())
    with pytest.raises(VerlConfigError, match="not a directory"):
        ModelRewardWorker(str(tmp_path / "missing"), torch.device("cpu"))


def test_rule_reward_worker():
    scores = RuleRewardWorker("arithmetic").score(_batch(["2", "3"], ["2", "2"]))
    assert scores.tolist() == [1.0, 0.0]
