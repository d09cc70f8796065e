"""Vocab-parallel log-prob / entropy on 2 gloo ranks equal the unsplit op, in values and in gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import verl.ops as O
from verl.testing import run_distributed

N, H, V, TEMP = 10, 12, 96, 0.8
IGNORE_ROWS = (1, 6)


def _problem(dtype):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(IGNORE_ROWS)] = -100
    labels[0], labels[2] = 0, V - 1  # first and last token: owned by rank 0 and the last rank
    up_lp = torch.randn(N, generator=g, dtype=torch.float64)
    up_ent = torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, labels, up_lp, up_ent


def _loss(lp, ent, up_lp, up_ent):
    return (lp.double() * up_lp + ent.double() * up_ent).sum()


CASES = [(torch.float64, "auto"), (torch.float64, "reference"), (torch.float32, "auto"), (torch.float32, "reference")]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _ranks_body(rank, world):
    """Every case in one spawn (spawning gloo ranks costs seconds); results keyed by (dtype, backend)."""
    group = dist.new_group(list(range(world)))
    out = {case: _one_case(rank, world, group, *case) for case in CASES}
    out["bad_label"] = _bad_label_message()
    return out


def _one_case(rank, world, group, dtype, backend):
    """Each rank runs both vocab-parallel ops on its slice; returns values and local gradients."""
    hidden, weight, labels, up_lp, up_ent = _problem(dtype)
    vs = V // world
    w_shard = weight[rank * vs:(rank + 1) * vs].clone()
    out = {}
    with O.backend(backend):
        logits = (hidden @ weight.t())[:, rank * vs:(rank + 1) * vs].clone().requires_grad_()
        lp, ent = O.vocab_parallel_logprob_entropy(logits, labels, TEMP, group)
        _loss(lp, ent, up_lp, up_ent).backward()
        out["logits"] = (lp.detach(), ent.detach(), logits.grad)

        h = hidden.clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        lp, ent = O.vocab_parallel_linear_logprob_entropy(h, w, labels, TEMP, group, chunk_n=4, chunk_v=16)
        _loss(lp, ent, up_lp, up_ent).backward()
        out["linear"] = (lp.detach(), ent.detach(), h.grad, w.grad)
    return out


def _unsplit(dtype):
    hidden, weight, labels, up_lp, up_ent = _problem(dtype)
    h = hidden.double().clone().requires_grad_()
    w = weight.double().clone().requires_grad_()
    logits = (hidden @ weight.t()).double().clone().requires_grad_()
    lp, ent = O.logprob_entropy_ref(logits, labels, TEMP)
    _loss(lp, ent, up_lp, up_ent).backward()
    lp2, ent2 = O.linear_logprob_entropy_ref(h, w, labels, TEMP)
    _loss(lp2, ent2, up_lp, up_ent).backward()
    return (lp.detach(), ent.detach(), logits.grad), (lp2.detach(), ent2.detach(), h.grad, w.grad)


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_ranks_body, world_size=2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0]).split('.')[-1]}-{c[1]}")
def test_vocab_parallel_equals_unsplit(two_rank_results, case):
    dtype, tol = case[0], TOL[case[0]]
    results = [r[case] for r in two_rank_results]
    (lp, ent, g_logits), (lp2, ent2, g_h, g_w) = _unsplit(dtype)

    def close(a, b):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)

    for r in results:  # outputs are replicated on every rank
        close(r["logits"][0], lp)
        close(r["logits"][1], ent)
        close(r["linear"][0], lp2)
        close(r["linear"][1], ent2)
        close(r["linear"][2], g_h)  # grad_hidden all-reduced over the group
    close(torch.cat([r["logits"][2] for r in results], dim=1), g_logits)
    close(torch.cat([r["linear"][3] for r in results], dim=0), g_w)
    assert (results[0]["logits"][0][list(IGNORE_ROWS)] == 0).all()


def _bad_label_message() -> str:
    """A label beyond the whole vocabulary (V/tp * tp = 16 here) is an error on every rank, before any
    collective, so no rank is left waiting in an all-reduce."""
    try:
        O.vocab_parallel_logprob_entropy(torch.randn(3, 8), torch.tensor([0, 16, 1]), 1.0, None)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_vocab_parallel_rejects_labels_beyond_the_whole_vocabulary(two_rank_results):
    for r in two_rank_results:
        assert "`labels`[1] = 16 is outside the vocabulary [0, 16)" in r["bad_label"]


def test_vocab_parallel_on_one_process_is_the_plain_op():
    """Without torch.distributed (one process) the vocabulary is whole: the same values as logprob_entropy."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    logits, labels = torch.randn(2, 4), torch.tensor([0, 3])
    for got, want in zip(O.vocab_parallel_logprob_entropy(logits, labels, 0.7, None),
                         O.logprob_entropy(logits, labels, 0.7)):
        torch.testing.assert_close(got, want)