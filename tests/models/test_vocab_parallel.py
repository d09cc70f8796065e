"""The one vocab-parallel log-prob path (`verl.ops.vocab_parallel_logprob_entropy`) on one process, where the
vocabulary is whole, against torch.log_softmax; and the megatron padding mask (TP sharding is covered by the
ops' two-rank tests and the layout matrix, where every loss and gradient goes through it)."""

from __future__ import annotations

import pytest
import torch

from verl.ops import vocab_parallel_logprob_entropy


def _reference(logits, labels, t, ignore_index=-100):
    logp = torch.log_softmax(logits / t, -1)
    valid = labels != ignore_index
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid
    return lp, -(logp.exp() * logp).sum(-1) * valid  # verl.ops: 0 (and no gradient) on ignored labels


@pytest.mark.parametrize("t", [1.0, 0.6, 1.7])
def test_one_process_matches_log_softmax_values_and_grads(t):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, -1] = -100
    w1, w2 = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    a = logits.float().clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(a, labels, t, None)
    ((lp * w1.float()).sum() + (ent * w2.float()).sum()).backward()
    b = logits.clone().requires_grad_()
    rlp, rent = _reference(b, labels, t)
    ((rlp * w1).sum() + (rent * w2).sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)
    assert lp[0, -1] == 0 and ent[0, -1] == 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0, None)
    with pytest.raises(ValueError, match="must match"):
        vocab_parallel_logprob_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), 1.0, None)
