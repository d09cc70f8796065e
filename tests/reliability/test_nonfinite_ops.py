"""One behaviour for non-finite inputs of the log-prob family, the same on both backends (fused kernels and the
pure-PyTorch references), tested on each op (the rule: verl/ops/logprob.py and csrc/include/verl/logprob.h):

- a logit of -inf is a token of probability 0: finite results, and a target at -inf has log-prob -inf;
- a NaN or +inf logit, or a row of nothing but -inf, leaves the row without a softmax: its log-prob and entropy
  are NaN (never +inf or a finite number a loss could take for a value), and so is its gradient;
- other rows are untouched.
And the loss aggregations: a global token / sequence count of 0 while the batch has valid tokens (which would
weigh every token 0 and return a loss of exactly 0) is an error naming the count, on both backends.
"""

from __future__ import annotations

import pytest
import torch

import verl.ops as O

NAN, INF = float("nan"), float("inf")
BACKENDS = ("fused", "reference")


def _logits(value: float, where: str, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[4, 70] logits (more than one SIMD block per row) and labels; row 0 gets `value` at the label ("target"),
    elsewhere ("other"), or everywhere ("row"); rows 1-3 stay finite."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 70, generator=g, dtype=dtype)
    labels = torch.tensor([5, 6, 7, 8])
    if where == "target":
        x[0, 5] = value
    elif where == "other":
        x[0, 40] = value
    else:
        x[0] = value
    return x, labels


def _ops(x: torch.Tensor, labels: torch.Tensor):
    """(name, fn) of every op of the family over the same logits (the linear one through an identity head, where
    an infinite hidden value times the head's zeros makes NaN logits: its -inf cases are NaN rows too)."""
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return {
        "logprob_entropy": lambda: O.logprob_entropy(x, labels),
        "logprob_entropy_t2": lambda: O.logprob_entropy(x, labels, temperature=2.0),
        "linear_logprob_entropy": lambda: O.linear_logprob_entropy(x, eye, labels),
    }


def _run(op: str, x: torch.Tensor, labels: torch.Tensor, backend: str):
    O.set_backend(backend)
    try:
        xg = x.clone().requires_grad_(True)
        lp, ent = _ops(xg, labels)[op]()
        (lp.nan_to_num(0.0, 0.0, 0.0).sum() + ent.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
        return lp.detach(), ent.detach(), xg.grad
    finally:
        O.set_backend("fused")


CASES = [(v, w) for v in (NAN, INF, -INF) for w in ("target", "other", "row")]
OPS = list(_ops(*_logits(0.0, "other")))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("value, where", CASES, ids=[f"{v}-{w}" for v, w in CASES])
def test_behaves_nonfinite_logits_give_one_answer_on_both_backends(op, value, where):
    x, labels = _logits(value, where)
    (lp_f, ent_f, g_f), (lp_r, ent_r, g_r) = (_run(op, x, labels, b) for b in BACKENDS)
    # the defined result of row 0
    nan_row = value != value or value == INF or where == "row" or (op.startswith("linear") and value == -INF)
    if nan_row:
        assert lp_f[0].isnan() and ent_f[0].isnan(), (lp_f[0], ent_f[0])
    elif where == "target":  # -inf at the target: probability 0
        assert lp_f[0] == -INF and ent_f[0].isfinite()
    else:
        assert lp_f[0].isfinite() and ent_f[0].isfinite()
    # both backends alike: the same non-finite pattern, the finite values equal to rounding, rows 1-3 untouched
    for a, b in ((lp_f, lp_r), (ent_f, ent_r), (g_f, g_r)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert lp_f[1:].isfinite().all() and ent_f[1:].isfinite().all() and g_f[1:].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_behaves_nonfinite_rule_holds_in_every_dtype(dtype):
    x, labels = _logits(NAN, "other", dtype)
    for backend in BACKENDS:
        lp, ent, _ = _run("logprob_entropy", x, labels, backend)
        assert lp[0].isnan() and ent[0].isnan() and lp[1:].isfinite().all(), backend


def test_behaves_nan_in_a_later_vocab_chunk_stays_nan():
    """The linear op folds the vocabulary chunk by chunk: a NaN in the second chunk still poisons the row,
    and a finite chunk after it cannot fold it away."""
    x, labels = _logits(0.0, "other")
    w = torch.eye(70)
    w[60, 0] = NAN  # vocab row 60 lies in the second chunk of 32
    for backend in BACKENDS:
        O.set_backend(backend)
        try:
            lp, ent = O.linear_logprob_entropy(x, w, labels, chunk_v=32)
        finally:
            O.set_backend("fused")
        assert lp.isnan().all() and ent.isnan().all(), backend


def _full():
    return torch.ones(3, 4, dtype=torch.bool)


LOSSES = {
    "agg_loss": lambda agg, m: O.agg_loss(torch.randn(3, 4), m, agg),
    "kl_loss": lambda agg, m: O.kl_loss(torch.randn(3, 4), torch.randn(3, 4), m, agg=agg),
    "policy_loss": lambda agg, m: O.policy_loss(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), m,
                                                agg=agg).loss,
    "value_loss": lambda agg, m: O.value_loss(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), m,
                                              agg=agg).loss,
    "linear_rl_loss": lambda agg, m: O.linear_rl_loss(torch.randn(3, 4, 8), torch.randn(16, 8),
                                                      torch.randint(0, 16, (3, 4)), m, torch.randn(3, 4),
                                                      agg=agg).loss,
}
ZERO_COUNTS = [("global_tokens", dict(mode="token-mean", global_tokens=0.0, global_seqs=3.0)),
               ("global_seqs", dict(mode="seq-mean-token-mean", global_tokens=12.0, global_seqs=0.0))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count, agg", ZERO_COUNTS, ids=[c for c, _ in ZERO_COUNTS])
@pytest.mark.parametrize("op", list(LOSSES))
def test_clear_zero_global_count_with_valid_tokens(op, count, agg, backend):
    O.set_backend(backend)
    try:
        with pytest.raises(ValueError, match=rf"{op}: `{count}`=0 but `mask` has 12 valid tokens"):
            LOSSES[op](O.Aggregation(**agg), _full())
    finally:
        O.set_backend("fused")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(LOSSES))
def test_behaves_zero_global_count_without_valid_tokens_is_zero(op, backend):
    """A rank whose share of the step is all padding legitimately sees counts of 0: its loss is 0, as before."""
    O.set_backend(backend)
    try:
        agg = O.Aggregation(mode="token-mean", global_tokens=0.0, global_seqs=0.0)
        assert float(LOSSES[op](agg, torch.zeros(3, 4, dtype=torch.bool))) == 0.0
    finally:
        O.set_backend("fused")
