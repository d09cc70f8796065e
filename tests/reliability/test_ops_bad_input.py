"""One table of bad op arguments, run against both backends: the fused kernels (verl._C) and the pure-PyTorch
references (what runs when verl._C is missing). Each case must raise the same error type with the same message on
both, the message must name the argument, and the kernel called directly (torch.ops.verl.*, skipping the Python
check) must refuse it too, naming the same argument: the Python checks mirror the C++ ones, neither more nor less.

Also: NaN/inf at padded (mask = 0) positions never reach any masked result, on either backend.
"""

from __future__ import annotations

import math

import pytest
import torch

import verl.ops as O
from verl import _extension
from tests.conftest import needs_ext

NAN, INF = float("nan"), float("inf")
AGG = ("token-mean", None, None, 1, None)


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


X, M, IDX = _x(3, 4), torch.ones(3, 4, dtype=torch.bool), torch.tensor([0, 0, 1])
LOGITS, LABELS = _x(3, 10), torch.tensor([1, 2, 3])
H, W = _x(3, 4), _x(10, 4)
V = torch.ops.verl if _extension.available() else None


def _gae(**kw):
    a = dict(token_level_rewards=X, values=X, response_mask=M, gamma=1.0, lam=1.0)
    a.update(kw)
    return lambda: O.compute_gae(**a)


def _gae_raw(**kw):
    a = dict(rewards=X, values=X, mask=M, gamma=1.0, lam=1.0)
    a.update(kw)
    return lambda: V.gae(a["rewards"], a["values"], a["mask"], a["gamma"], a["lam"])


def _pg(**kw):
    a = dict(logprob=X, old_logprob=X, advantages=X, mask=M, loss_type="vanilla", clip_low=0.2, clip_high=0.2,
             clip_c=3.0)
    a.update(kw)
    return (lambda: O.policy_loss(a["logprob"], a["old_logprob"], a["advantages"], a["mask"], a["loss_type"],
                                  clip_low=a["clip_low"], clip_high=a["clip_high"], clip_c=a["clip_c"]),
            lambda: V.policy_loss(a["logprob"], a["old_logprob"], a["advantages"], a["mask"], a["loss_type"],
                                  a["clip_low"], a["clip_high"], a["clip_c"], *AGG, False))


def _vf(**kw):
    a = dict(values=X, old_values=X, returns=X, mask=M, clip=0.5)
    a.update(kw)
    return (lambda: O.value_loss(a["values"], a["old_values"], a["returns"], a["mask"], a["clip"]),
            lambda: V.value_loss(a["values"], a["old_values"], a["returns"], a["mask"], a["clip"], *AGG, False))


def _outcome(**kw):
    a = dict(rewards=X, mask=M, index=IDX, estimator="grpo", eps=1e-6, baseline=None)
    a.update(kw)
    return (lambda: O.outcome_advantage(a["rewards"], a["mask"], a["index"], a["estimator"], eps=a["eps"],
                                        baseline=a["baseline"]),
            lambda: V.outcome_advantage(a["rewards"], a["mask"], a["index"], a["estimator"], a["eps"], True,
                                        a["baseline"]))


def _kl_loss(**kw):
    a = dict(logprob=X, ref_logprob=X, mask=M, kind="k3")
    a.update(kw)
    return (lambda: O.kl_loss(a["logprob"], a["ref_logprob"], a["mask"], a["kind"]),
            lambda: V.kl_loss(a["logprob"], a["ref_logprob"], a["mask"], a["kind"], *AGG, False))


def _lp(**kw):
    a = dict(logits=LOGITS, labels=LABELS, temperature=1.0)
    a.update(kw)
    return (lambda: O.logprob_entropy(a["logits"], a["labels"], a["temperature"]),
            lambda: V.logprob_entropy(a["logits"], a["labels"], a["temperature"], -100))


def _lin(**kw):
    a = dict(hidden=H, weight=W, labels=LABELS, temperature=1.0, chunk_n=2, chunk_v=4)
    a.update(kw)
    return (lambda: O.linear_logprob_entropy(a["hidden"], a["weight"], a["labels"], a["temperature"],
                                             chunk_n=a["chunk_n"], chunk_v=a["chunk_v"]),
            lambda: V.linear_logprob_entropy(a["hidden"], a["weight"], a["labels"], a["temperature"], -100,
                                             a["chunk_n"], a["chunk_v"]))


def _masked(op, values=X, mask=M, **kw):
    return (lambda: getattr(O, op)(values, mask, **kw),
            lambda: getattr(V, op)(values, mask, *kw.values()) if op != "masked_whiten"
            else V.masked_whiten(values, mask, True, kw.get("eps", 1e-8)))


# id -> (wrapper call, direct kernel call, expected exception type, the argument the message must name)
CASES = {
    # GAE (csrc/include/verl/rl_advantage.h)
    "gae gamma=2": (_gae(gamma=2.0), _gae_raw(gamma=2.0), ValueError, "gamma"),
    "gae gamma=-0.1": (_gae(gamma=-0.1), _gae_raw(gamma=-0.1), ValueError, "gamma"),
    "gae gamma=nan": (_gae(gamma=NAN), _gae_raw(gamma=NAN), ValueError, "gamma"),
    "gae lam=nan": (_gae(lam=NAN), _gae_raw(lam=NAN), ValueError, "lam"),
    "gae lam=1.5": (_gae(lam=1.5), _gae_raw(lam=1.5), ValueError, "lam"),
    "gae lam=inf": (_gae(lam=INF), _gae_raw(lam=INF), ValueError, "lam"),
    "gae values float64": (_gae(values=X.double()), _gae_raw(values=X.double()), TypeError, "values"),
    "gae values broadcast [1,4]": (_gae(values=X[:1]), _gae_raw(values=X[:1]), ValueError, "values"),
    "gae mask broadcast [3,1]": (_gae(response_mask=M[:, :1]), _gae_raw(mask=M[:, :1]), ValueError, "mask"),
    "gae mask complex": (_gae(response_mask=M.to(torch.complex64)), _gae_raw(mask=M.to(torch.complex64)),
                         TypeError, "mask"),
    "gae rewards int": (_gae(token_level_rewards=M.long(), values=None), _gae_raw(rewards=M.long(), values=None),
                        TypeError, "rewards"),
    "gae rewards 1-D": (_gae(token_level_rewards=X[0], values=None, response_mask=M[0]),
                        _gae_raw(rewards=X[0], values=None, mask=M[0]), ValueError, "rewards"),
    "gae rewards empty": (_gae(token_level_rewards=X[:0], values=None, response_mask=M[:0]),
                          _gae_raw(rewards=X[:0], values=None, mask=M[:0]), ValueError, "rewards"),
    # outcome advantages
    "outcome eps=-1": (*_outcome(eps=-1.0), ValueError, "eps"),
    "outcome eps=nan": (*_outcome(eps=NAN), ValueError, "eps"),
    "outcome remax without baseline": (*_outcome(estimator="remax"), ValueError, "baseline"),
    "outcome baseline for grpo": (*_outcome(baseline=torch.zeros(3)), ValueError, "baseline"),
    "outcome baseline int": (*_outcome(estimator="remax", baseline=torch.zeros(3, dtype=torch.long)), TypeError,
                             "baseline"),
    "outcome baseline [2]": (*_outcome(estimator="remax", baseline=torch.zeros(2)), ValueError, "baseline"),
    "outcome mask [3,1]": (*_outcome(mask=M[:, :1]), ValueError, "mask"),
    "outcome rewards float16 + mask complex": (*_outcome(rewards=X.half(), mask=M.to(torch.complex64)), TypeError,
                                               "mask"),
    # policy loss (make_pg / check_like)
    "policy clip_low=1": (*_pg(clip_low=1.0), ValueError, "clip_low"),
    "policy clip_low=-0.1": (*_pg(clip_low=-0.1), ValueError, "clip_low"),
    "policy clip_low=nan": (*_pg(clip_low=NAN), ValueError, "clip_low"),
    "policy clip_high=-0.2": (*_pg(clip_high=-0.2), ValueError, "clip_high"),
    "policy clip_high=nan": (*_pg(clip_high=NAN), ValueError, "clip_high"),
    "policy clip_c=1": (*_pg(clip_c=1.0), ValueError, "clip_c"),
    "policy clip_c=nan": (*_pg(clip_c=NAN), ValueError, "clip_c"),
    "policy old_logprob float64": (*_pg(old_logprob=X.double()), TypeError, "old_logprob"),
    "policy advantages bfloat16": (*_pg(advantages=X.bfloat16()), TypeError, "advantages"),
    "policy advantages broadcast [3,1]": (*_pg(advantages=X[:, :1]), ValueError, "advantages"),
    "policy mask [1,4]": (*_pg(mask=M[:1]), ValueError, "mask"),
    "policy logprob 3-D": (*_pg(logprob=X[None], old_logprob=X[None], advantages=X[None], mask=M[None]), ValueError,
                           "logprob"),
    # value loss
    "value clip=-0.1": (*_vf(clip=-0.1), ValueError, "clip"),
    "value clip=nan": (*_vf(clip=NAN), ValueError, "clip"),
    "value returns float64": (*_vf(returns=X.double()), TypeError, "returns"),
    "value old_values [3,1]": (*_vf(old_values=X[:, :1]), ValueError, "old_values"),
    "value values int": (*_vf(values=M.long(), old_values=M.long(), returns=M.long()), TypeError, "values"),
    # KL loss
    "kl_loss ref float64": (*_kl_loss(ref_logprob=X.double()), TypeError, "ref_logprob"),
    "kl_loss ref broadcast [1,4]": (*_kl_loss(ref_logprob=X[:1]), ValueError, "ref_logprob"),
    "kl_loss mask [4,3]": (*_kl_loss(mask=M.t()), ValueError, "mask"),
    # masked reductions (csrc/cpu/masked.cpp)
    "masked_sum dim=5": (*_masked("masked_sum", dim=5), ValueError, "dim"),
    "masked_mean dim=-3": (*_masked("masked_mean", dim=-3), ValueError, "dim"),
    "masked_sum 0-d with dim": (*_masked("masked_sum", values=torch.tensor(1.0), mask=torch.tensor(True), dim=0),
                                ValueError, "dim"),
    "masked_mean values int": (*_masked("masked_mean", values=M.long()), TypeError, "values"),
    "masked_var mask broadcast": (*_masked("masked_var", mask=M[:1]), ValueError, "mask"),
    "masked_sum mask complex": (*_masked("masked_sum", mask=M.to(torch.complex64)), TypeError, "mask"),
    "masked_whiten eps=-1": (*_masked("masked_whiten", eps=-1.0), ValueError, "eps"),
    "masked_whiten eps=nan": (*_masked("masked_whiten", eps=NAN), ValueError, "eps"),
    # log-prob / entropy (csrc/include/verl/logprob.h)
    "logprob temperature=0": (*_lp(temperature=0.0), ValueError, "temperature"),
    "logprob temperature=nan": (*_lp(temperature=NAN), ValueError, "temperature"),
    "logprob temperature=inf": (*_lp(temperature=INF), ValueError, "temperature"),
    "logprob logits int": (*_lp(logits=LOGITS.long()), TypeError, "logits"),
    "logprob empty vocab": (*_lp(logits=LOGITS[:, :0]), ValueError, "logits"),
    "logprob label out of vocab": (*_lp(labels=torch.tensor([1, 10, 3])), ValueError, "labels"),
    "logprob label negative": (*_lp(labels=torch.tensor([-1, 0, 0])), ValueError, "labels"),
    "logprob labels float": (*_lp(labels=LABELS.float()), TypeError, "labels"),
    "logprob labels [2]": (*_lp(labels=LABELS[:2]), ValueError, "labels"),
    "linear weight float64": (*_lin(weight=W.double()), TypeError, "weight"),
    "linear weight H mismatch": (*_lin(weight=_x(10, 5)), ValueError, "weight"),
    "linear weight 1-D": (*_lin(weight=_x(10)), ValueError, "weight"),
    "linear empty vocab": (*_lin(weight=W[:0]), ValueError, "weight"),
    "linear hidden int": (*_lin(hidden=H.long(), weight=W.long()), TypeError, "hidden"),
    "linear chunk_v=0": (*_lin(chunk_v=0), ValueError, "chunk_v"),
    "linear chunk_n=-1": (*_lin(chunk_n=-1), ValueError, "chunk_n"),
    "linear temperature=-1": (*_lin(temperature=-1.0), ValueError, "temperature"),
    "linear label out of vocab": (*_lin(labels=torch.tensor([0, 0, 10])), ValueError, "labels"),
}


def _error(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@needs_ext
@pytest.mark.parametrize("case", list(CASES))
def test_clear_both_backends_refuse_alike_and_name_the_argument(case):
    wrapper, raw, exc_type, arg = CASES[case]
    errors = {}
    for mode in ("fused", "reference"):
        with O.backend(mode):
            errors[mode] = _error(wrapper)
    fused, ref = errors["fused"], errors["reference"]
    assert type(fused) is type(ref) and str(fused) == str(ref), (fused, ref)
    assert isinstance(fused, exc_type), repr(fused)
    assert f"`{arg}`" in str(fused), str(fused)
    # The kernel itself refuses the same input and names the same argument (its own TORCH_CHECK).
    kernel = _error(raw)
    assert isinstance(kernel, RuntimeError) and f"`{arg}`" in str(kernel), repr(kernel)


def test_clear_reference_refuses_without_the_extension(monkeypatch):
    """As if verl._C were missing: the fallback still refuses every bad input of the table the same way."""
    from verl.ops import _backend
    monkeypatch.setattr(_backend, "_KERNELS", {})
    monkeypatch.setattr(_extension, "available", lambda: False)
    monkeypatch.setattr(_extension, "_warned", set())
    for case, (wrapper, _, exc_type, arg) in CASES.items():
        err = _error(wrapper)
        assert isinstance(err, exc_type) and f"`{arg}`" in str(err), (case, err)


# ------------------------------------------------------------------------ NaN / inf at padded positions

def _poisoned(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(4, 9, dtype=dtype)
    m = torch.rand(4, 9) > 0.3
    m[:, 0] = True
    clean = torch.where(m, x, torch.zeros((), dtype=dtype))
    bad = x.clone()
    pad = (~m).nonzero()
    for k, (i, j) in enumerate(pad.tolist()):
        bad[i, j] = (NAN, INF, -INF)[k % 3]
    return clean, bad, m


MASKED_CALLS = {
    "masked_sum": lambda v, m: O.masked_sum(v, m),
    "masked_sum dim=1": lambda v, m: O.masked_sum(v, m, 1),
    "masked_sum dim=0": lambda v, m: O.masked_sum(v, m, 0),
    "masked_mean": lambda v, m: O.masked_mean(v, m),
    "masked_mean dim=1": lambda v, m: O.masked_mean(v, m, 1),
    "masked_mean dim=0": lambda v, m: O.masked_mean(v, m, 0),
    "masked_var": lambda v, m: O.masked_var(v, m),
    "masked_whiten": lambda v, m: O.masked_whiten(v, m),
    "agg_loss token-mean": lambda v, m: O.agg_loss(v, m, "token-mean"),
    "agg_loss seq-mean-token-mean": lambda v, m: O.agg_loss(v, m, "seq-mean-token-mean"),
    "gae": lambda v, m: O.compute_gae(v, v, m, 0.9, 0.8).advantages,
    "grpo": lambda v, m: O.outcome_advantage(v, m, [0, 0, 1, 1], "grpo").advantages,
    "kl_loss": lambda v, m: O.kl_loss(v, v * 0.5, m, "k3"),
    "policy_loss": lambda v, m: O.policy_loss(v, v * 0.9, v, m).loss,
    "value_loss": lambda v, m: O.value_loss(v, v * 0.9, v, m).loss,
}


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("name", list(MASKED_CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_behaves_nan_inf_at_padding_never_reaches_the_result(backend, name, dtype):
    if backend == "fused" and not _extension.available():
        pytest.skip("verl._C is not built")
    clean, bad, m = _poisoned(dtype)
    with O.backend(backend):
        want = MASKED_CALLS[name](clean, m)
        got = MASKED_CALLS[name](bad, m)
    assert torch.isfinite(got).all(), (name, got)
    torch.testing.assert_close(got, want, equal_nan=False)
    assert not math.isnan(float(got.sum()))
