"""The vocab-parallel log-prob/entropy reference on one process against torch.log_softmax (TP sharding is
covered by the layout matrix, where every loss and gradient goes through it)."""

from __future__ import annotations

import pytest
import torch

from verl.models.vocab_parallel import vocab_parallel_logprob_entropy_ref


def _reference(logits, labels, t, ignore_index=-100):
    logp = torch.log_softmax(logits / t, -1)
    valid = labels != ignore_index
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("t", [1.0, 0.6, 1.7])
def test_matches_log_softmax_values_and_grads(t):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, -1] = -100
    w1, w2 = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy_ref(a, labels, t)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    b = logits.clone().requires_grad_()
    rlp, rent = _reference(b, labels, t)
    ((rlp * w1).sum() + (rent * w2).sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    assert lp[0, -1] == 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy_ref(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_logprob_entropy_ref(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), 1.0)
