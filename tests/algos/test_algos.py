"""verl.algos: algorithms chosen by name, one calling convention per kind, helpful errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verl.algos as A
import verl.ops as O
from verl.errors import VerlConfigError


def _batch(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) > 0.2
    m[:, 0] = True
    return r, m


def test_every_advantage_estimator_runs_by_name_with_one_calling_convention():
    r, m = _batch()
    kw = dict(values=torch.randn_like(r), index=np.array(["a", "a", "b", "b", "c", "c"], dtype=object),
              baseline=torch.randn(6, dtype=torch.float64), gamma=0.99, lam=0.95)
    for name in A.ADVANTAGES.names():
        out = A.get_advantage(name)(r, m, **kw)
        assert isinstance(out, A.AdvantageResult) and out.advantages.shape == r.shape, name
        assert torch.isfinite(out.advantages).all() and (out.advantages[~m] == 0).all(), name


def test_estimators_match_their_definitions():
    r, m = _batch()
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    score = torch.where(m, r, 0.0).sum(-1)
    grpo = A.get_advantage("grpo")(r, m, index=idx).advantages[:, 0]
    dr = A.get_advantage("dr_grpo")(r, m, index=idx).advantages[:, 0]
    for gid in (0, 1):
        s = score[idx == gid]
        torch.testing.assert_close(dr[idx == gid], s - s.mean())
        torch.testing.assert_close(grpo[idx == gid], (s - s.mean()) / (s.std() + 1e-6))
    base = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(A.get_advantage("remax")(r, m, baseline=base).advantages[:, 0], score - base)
    rpp = A.get_advantage("reinforce++")(r, m, gamma=1.0)
    torch.testing.assert_close(rpp.returns[:, 0], score)  # gamma=1: return at token 0 is the sequence score


def test_missing_inputs_and_unknown_names_are_config_errors():
    r, m = _batch()
    with pytest.raises(VerlConfigError, match="'grpo' needs `index`"):
        A.get_advantage("grpo")(r, m)
    with pytest.raises(VerlConfigError, match="'gae' needs `values`"):
        A.get_advantage("gae")(r, m)
    with pytest.raises(VerlConfigError, match="'remax' needs `baseline`"):
        A.get_advantage("remax")(r, m)
    with pytest.raises(VerlConfigError, match=r"unknown advantage estimator 'gpro' \(did you mean 'grpo'\?\); "
                                              r"known: dr_grpo, gae, gpg, grpo"):
        A.get_advantage("gpro")
    with pytest.raises(VerlConfigError,
                       match="unknown policy loss 'vanila'.*known: cispo, .*gspo, .*ppo, reinforce, sapo, vanilla"):
        A.get_policy_loss("vanila")
    with pytest.raises(VerlConfigError, match="unknown KL penalty 'k4'.*known: abs, k1"):
        A.get_kl("k4")
    with pytest.raises(VerlConfigError, match="unknown aggregation mode 'seq-mean'"):
        A.check_agg_mode("seq-mean")


def test_registration_checks_signature_and_duplicates():
    reg = A.Registry("thing", required=("x", "y"))

    @reg.register("ok")
    def ok(x, y):
        return x + y

    with pytest.raises(VerlConfigError, match="must accept the parameters x, y; missing: y"):
        reg.register("bad")(lambda x: x)
    with pytest.raises(VerlConfigError, match="'ok' is already registered"):
        reg.register("ok")(lambda x, y: x)
    assert reg.get("ok") is ok and "ok" in reg


def test_policy_losses_by_name_match_the_ops():
    r, m = _batch()
    lp = (r * 0.2).requires_grad_()
    old, adv = lp.detach() + 0.1, torch.randn_like(r)
    agg = A.Aggregation(mode="seq-mean-token-mean")
    for name in ("vanilla", "gspo", "reinforce"):
        out = A.get_policy_loss(name)(lp, old, adv, m, clip_low=0.2, clip_high=0.28, agg=agg)
        want = O.policy_loss_ref(lp, old, adv, m, name, 0.2, 0.28, 3.0, agg)
        torch.testing.assert_close(out.loss, want.loss)
    assert A.get_policy_loss("ppo") is A.get_policy_loss("vanilla")


def test_kl_loss_fuses_builtins_and_aggregates_registered_functions():
    r, m = _batch()
    ref = r + 0.1
    for name in ("kl", "k1", "abs", "mse", "low_var_kl", "k3", "k3+"):
        want = O.agg_loss_ref(O.kl_penalty_ref(r, ref, name), m, "token-mean")
        torch.testing.assert_close(A.kl_loss(name, r, ref, m), want)

    @A.register_kl("test_half_sq_of_ratio")
    def half_sq(logprob, ref_logprob):
        return 0.5 * torch.expm1(logprob - ref_logprob) ** 2

    got = A.kl_loss("test_half_sq_of_ratio", r, ref, m, "seq-mean-token-sum")
    torch.testing.assert_close(got, O.agg_loss_ref(half_sq(r, ref), m, "seq-mean-token-sum"))


def test_entropy_and_value_loss_entry_points():
    r, m = _batch()
    torch.testing.assert_close(A.entropy_loss(r.abs(), m), O.masked_mean_ref(r.abs(), m))
    out = A.value_loss(r, r + 0.3, r + 1.0, m, 0.2, agg="token-mean")
    torch.testing.assert_close(out.loss, O.value_loss_ref(r, r + 0.3, r + 1.0, m, 0.2).loss)
