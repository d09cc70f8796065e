"""verl RL kernels (GAE, outcome advantages, KL, fused losses): kernels against the references, gradients,
opcheck, torch.compile over a whole PPO loss, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verl.ops as O
from tests.conftest import devices, needs_ext
from verl import _extension
from verl.errors import VerlConfigError, VerlRuntimeError

FLOATS = [torch.float32, torch.float64, torch.bfloat16]


def _tol(dtype):
    return {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]


def _masks(B, T, g):
    """Random holes, right padding, left padding, a fully masked row."""
    rnd = torch.rand(B, T, generator=g) > 0.3
    lens = torch.randint(0, T + 1, (B,), generator=g)
    ar = torch.arange(T)
    right = ar < lens[:, None]
    left = ar >= (T - lens)[:, None]
    out = [rnd, right, left]
    if B > 1:
        some_empty = rnd.clone()
        some_empty[0] = False
        out.append(some_empty)
    return out


def sample_inputs(device, dtype=torch.float32):
    """(tensors dict, mask) cases over several [B, T] shapes, masks and one non-contiguous layout."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for B, T in [(1, 1), (3, 5), (8, 33), (17, 128), (64, 300)]:
        for m in _masks(B, T, g):
            t = {k: torch.randn(B, T, generator=g, dtype=torch.float64) for k in ("a", "b", "c", "d")}
            t["b"] = t["a"] + 0.3 * t["b"]  # old log-probs / old values near the current ones
            cases.append(({k: v.to(device=device, dtype=dtype) for k, v in t.items()}, m.to(device)))
    nc = {k: torch.randn(40, 24, generator=g).to(device=device, dtype=dtype).t() for k in ("a", "b", "c", "d")}
    cases.append((nc, (torch.rand(40, 24, generator=g) > 0.4).to(device).t()))
    return cases


def _close(got, want, dtype, scale=None):
    got, want = got.detach(), want.detach()
    scale = scale if scale is not None else max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), atol=_tol(dtype) * scale * 4, rtol=_tol(dtype) * 4)


# ---------------------------------------------------------------------------------------------- advantages

@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
def test_gae_matches_reference(device, dtype):
    for t, m in sample_inputs(device, dtype):
        for values in (t["b"], None):
            adv, ret, bad = torch.ops.verl.gae(t["a"], values, m, 0.97, 0.9)
            want = O.compute_gae_ref(t["a"].double(), None if values is None else values.double(), m, 0.97, 0.9)
            assert adv.dtype == dtype and adv.shape == t["a"].shape and int(bad) == 0
            _close(adv, want.advantages, dtype)
            _close(ret, want.returns, dtype)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
def test_outcome_advantages_match_reference(device, dtype):
    g = torch.Generator().manual_seed(3)
    for t, m in sample_inputs(device, dtype):
        B = m.shape[0]
        index = torch.randint(0, max(1, B // 3), (B,), generator=g).to(device) * 7919  # sparse ids, singletons
        base = torch.randn(B, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        for est in O.OUTCOME_ESTIMATORS:
            for norm in (True, False):
                b = base if est == "remax" else None
                got, bad = torch.ops.verl.outcome_advantage(t["a"], m, index, est, 1e-6, norm, b)
                want, _ = O.outcome_advantage_ref(t["a"].double(), m, index, est, 1e-6, norm,
                                                  None if b is None else b.double())
                assert int(bad) == 0
                # bf16 scores are sums of T rounded rewards: compare at the score scale.
                _close(got, want, dtype, scale=max(1.0, float(want.abs().max())) * (m.shape[1] ** 0.5))


@needs_ext
def test_outcome_singletons_and_constant_groups_are_zero():
    r = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 5.0], [5.0, 5.0]])
    m = torch.ones(4, 2, dtype=torch.bool)
    idx = torch.tensor([0, 1, 2, 2])
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = torch.ops.verl.outcome_advantage(r, m, idx, est, 1e-6, True, None)
        assert torch.equal(adv, torch.zeros(4, 2)), est


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
def test_kl_penalty_matches_reference(device, dtype):
    for t, _ in sample_inputs(device, dtype)[::3]:
        for kind in O.KL_KINDS:
            a = t["a"].detach().clone().requires_grad_()
            b = t["a"].double().detach().clone().requires_grad_()
            up = t["c"].double()
            got = O.kl_penalty(a, t["b"], kind)
            want = O.kl_penalty_ref(b, t["b"].double(), kind)
            _close(got, want, dtype)
            (got.double() * up).sum().backward()
            (want * up).sum().backward()
            _close(a.grad, b.grad, dtype, scale=max(1.0, float(b.grad.abs().max())))


def _grad_pair(fused_fn, ref_fn, x, dtype):
    a = x.detach().clone().requires_grad_()
    b = x.double().detach().clone().requires_grad_()
    fo, ro = fused_fn(a), ref_fn(b)
    fo[0].backward()
    ro[0].backward()
    return fo, ro, a.grad, b.grad


AGGS = [O.Aggregation(mode=m) for m in O.AGG_MODES] + [
    O.Aggregation(mode="token-mean", global_tokens=1000.0, dp_size=4),
    O.Aggregation(mode="seq-mean-token-sum-norm", global_seqs=37.0, dp_size=2, norm_len=512.0),
    O.Aggregation(mode="seq-mean-token-mean", global_seqs=5.0)]  # a count of 0 with valid tokens is refused


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("loss_type", O.POLICY_LOSSES)
def test_policy_loss_matches_reference(device, dtype, loss_type):
    for i, (t, m) in enumerate(sample_inputs(device, dtype)):
        _check_policy_case(t, m, AGGS[i % len(AGGS)], loss_type, dtype)


def _check_policy_case(t, m, agg, loss_type, dtype):
    # Log-ratios ~ N(0, 0.3) clip often; a shifted subset (ratio ~ e^1.5) exercises the dual clip.
    lp, adv = t["a"], t["c"]
    old = t["b"] - 1.5 * (t["d"] > 1.0).to(dtype)

    def fused(x):
        return O.policy_loss(x, old, adv, m, loss_type, clip_low=0.2, clip_high=0.28, clip_c=3.0, agg=agg)

    def ref(x):
        return O.policy_loss_ref(x, old.double(), adv.double(), m, loss_type, 0.2, 0.28, 3.0, agg)

    fo, ro, ga, gb = _grad_pair(fused, ref, lp, dtype)
    assert fo.loss.dtype == dtype and fo.pg_clipfrac.dtype == torch.float32
    _close(fo.loss, ro.loss, dtype)
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        _close(getattr(fo, k), getattr(ro, k), torch.float32 if dtype == torch.float64 else dtype)
    _close(ga, gb, dtype, scale=max(1e-3, float(gb.abs().max())))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
def test_value_kl_and_agg_losses_match_reference(device, dtype):
    for i, (t, m) in enumerate(sample_inputs(device, dtype)):
        _check_value_kl_agg_case(t, m, AGGS[i % len(AGGS)], list(O.KL_KINDS)[i % len(O.KL_KINDS)], dtype)


def _check_value_kl_agg_case(t, m, agg, kind, dtype):
    fo, ro, ga, gb = _grad_pair(lambda x: O.value_loss(x, t["b"], t["c"], m, 0.2, agg=agg),
                                lambda x: O.value_loss_ref(x, t["b"].double(), t["c"].double(), m, 0.2, agg),
                                t["a"], dtype)
    _close(fo.loss, ro.loss, dtype)
    _close(fo.vf_clipfrac, ro.vf_clipfrac, torch.float32 if dtype == torch.float64 else dtype)
    _close(ga, gb, dtype, scale=max(1e-3, float(gb.abs().max())))
    fo, ro, ga, gb = _grad_pair(lambda x: (O.kl_loss(x, t["b"], m, kind, agg),),
                                lambda x: (O.kl_loss_ref(x, t["b"].double(), m, kind, agg),), t["a"], dtype)
    _close(fo[0], ro[0], dtype)
    _close(ga, gb, dtype, scale=max(1e-3, float(gb.abs().max())))
    fo, ro, ga, gb = _grad_pair(lambda x: (O.agg_loss(x, m, agg),), lambda x: (O.agg_loss_ref(x, m, agg),),
                                t["d"], dtype)
    _close(fo[0], ro[0], dtype)
    _close(ga, gb, dtype, scale=max(1e-3, float(gb.abs().max())))


# ---------------------------------------------------------------------------------------------- gradients

@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    g = torch.Generator().manual_seed(5)
    B, T = 4, 6

    def rnd(scale=1.0):
        return (torch.randn(B, T, generator=g, dtype=torch.float64) * scale).to(device)

    m = (torch.rand(B, T, generator=g) > 0.25).to(device)
    x = rnd(0.3).requires_grad_()
    old, adv, ret = x.detach() + rnd(0.2), rnd(), rnd()
    fns = [lambda v, mode=mode: torch.ops.verl.agg_loss(v, m, mode, None, None, 1, None)[0] for mode in O.AGG_MODES]
    fns += [lambda v, lt=lt: torch.ops.verl.policy_loss(v, old, adv, m, lt, 0.2, 0.3, 2.0, "seq-mean-token-mean",
                                                         None, None, 1, None, True)[0]
            for lt in ("vanilla", "reinforce")]
    fns += [lambda v: torch.ops.verl.value_loss(v, old, ret, m, 0.1, "token-mean", 50.0, None, 2, None, True)[0]]
    fns += [lambda v, k=k: torch.ops.verl.kl_loss(v, old, m, k, "seq-mean-token-sum", None, None, 1, None, True)[0]
            for k in ("kl", "abs", "mse", "low_var_kl")]
    fns += [lambda v, k=k: torch.ops.verl.kl_penalty(v, old, k) for k in ("kl", "mse", "low_var_kl")]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-5)


@needs_ext
def test_gspo_and_straight_through_gradients_follow_their_definitions():
    """GSPO and k1+/k3+ use stop-gradients, so numerical gradcheck does not apply; check the formulas."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 8, generator=g, dtype=torch.float64) * 0.05).requires_grad_()
    old = x.detach() + torch.randn(3, 8, generator=g, dtype=torch.float64) * 0.05
    m = torch.ones(3, 8, dtype=torch.bool)
    adv = torch.randn(3, 8, generator=g, dtype=torch.float64)
    O.policy_loss(x, old, adv, m, "gspo", clip_low=10.0 / 11, clip_high=10.0, agg="token-mean").loss.backward()
    seq_ratio = torch.exp((x - old).mean(-1, keepdim=True)).detach()
    torch.testing.assert_close(x.grad, -adv * seq_ratio / x.numel())  # nothing clipped: -A * s / N
    for kind in ("k1+", "k3+"):
        y = x.detach().clone().requires_grad_()
        O.kl_penalty(y, old, kind).sum().backward()
        torch.testing.assert_close(y.grad, y.detach() - old)  # the gradient of k2


@needs_ext
@pytest.mark.parametrize("dtype", FLOATS)
def test_whitened_gae_matches_gae_then_masked_whiten(dtype):
    for t, m in sample_inputs("cpu", dtype):
        for values in (t["b"], None):
            adv, ret, bad = torch.ops.verl.gae(t["a"], values, m, 0.97, 0.9, 1e-8)
            raw = O.compute_gae_ref(t["a"].double(), None if values is None else values.double(), m, 0.97, 0.9)
            want = O.masked_whiten_ref(raw.advantages, m, eps=1e-8)
            # bf16 whitens its rounded raw advantages: allow the rounding of the raw values, scaled by 1/std
            scale = max(1.0, float(want.abs().max()))
            _close(adv, want, dtype, scale=scale if dtype != torch.bfloat16 else 4 * scale)
            _close(ret, raw.returns, dtype)
            assert int(bad) == 0
            assert torch.equal(adv[~m], torch.zeros_like(adv[~m]))


@needs_ext
@pytest.mark.parametrize("offset,spread", [(100.0, 1e-2), (10.0, 1e-3)])
def test_whitened_gae_with_a_large_common_offset(offset, spread):
    """Advantages ~ offset + small noise: the whitening statistics must not cancel (mean/std = 1e4)."""
    g = torch.Generator().manual_seed(3)
    B, T = 37, 203  # groups of 8 rows and a row tail, 8-step blocks and a head
    r = offset + torch.randn(B, T, generator=g) * spread
    m = torch.rand(B, T, generator=g) > 0.1
    adv, _, _ = torch.ops.verl.gae(r, torch.zeros(B, T), m, 0.0, 0.0, 1e-8)
    raw = O.compute_gae_ref(r.double(), None, m, 0.0, 0.0)
    want = O.masked_whiten_ref(raw.advantages, m, eps=1e-8)
    # float32 inputs carry offset * 6e-8 of rounding, i.e. ~1e-3 of the spread: compare at that level
    torch.testing.assert_close(adv.double(), want, atol=2e-2, rtol=0)


def _loss_op_calls(t, m, mode):
    """(name, with_grad -> outputs of the raw loss op, reference of the first input's gradient at grad = 1)."""
    agg = (mode, None, None, 1, None)
    a = O.Aggregation(mode=mode)
    for pg in O.POLICY_LOSSES:
        args = (t["a"], t["b"], t["c"], m, pg, 0.2, 0.28, 3.0)
        yield (f"policy_loss {pg}", lambda wg, args=args: torch.ops.verl.policy_loss(*args, *agg, wg),
               lambda x, pg=pg: O.policy_loss_ref(x, t["b"].double(), t["c"].double(), m, pg, 0.2, 0.28, 3.0, a).loss)
    for kind in ("kl", "abs", "mse", "low_var_kl", "k1+", "k3+"):
        yield (f"kl_loss {kind}", lambda wg, kind=kind: torch.ops.verl.kl_loss(t["a"], t["b"], m, kind, *agg, wg),
               lambda x, kind=kind: O.kl_loss_ref(x, t["b"].double(), m, kind, a))
    yield ("value_loss", lambda wg: torch.ops.verl.value_loss(t["a"], t["b"], t["d"], m, 0.3, *agg, wg),
           lambda x: O.value_loss_ref(x, t["b"].double(), t["d"].double(), m, 0.3, a).loss)


@needs_ext
@pytest.mark.parametrize("dtype", FLOATS)
def test_with_grad_adds_only_the_gradient_output(dtype):
    """with_grad=True returns the forward outputs of with_grad=False bit for bit, plus d loss / d input (the
    reference's autograd gradient); with_grad=False returns an empty [0] in its place."""
    for t, m in sample_inputs("cpu", dtype)[::3]:
        for mode in O.AGG_MODES:
            for name, call, ref in _loss_op_calls(t, m, mode):
                plain, fused = call(False), call(True)
                for got, want in zip(fused[:-1], plain[:-1]):
                    assert torch.equal(got, want), name
                assert plain[-1].shape == (0,) and fused[-1].shape == t["a"].shape, name
                x = t["a"].detach().double().clone().requires_grad_()
                ref(x).backward()
                _close(fused[-1], x.grad, dtype, scale=max(1e-3, float(x.grad.abs().max())))


@needs_ext
def test_backward_through_a_loss_op_called_without_grad_says_what_to_do():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    m = torch.ones(3, 4, dtype=torch.bool)
    loss = torch.ops.verl.value_loss(x, x.detach(), x.detach() + 1, m, 0.5, "token-mean", None, None, 1, None,
                                     False)[0]
    with pytest.raises(RuntimeError, match=r"verl::value_loss was called with with_grad=False.*with_grad=True"):
        loss.backward()


@needs_ext
def test_one_pass_gradients_scaled_and_to_both_kl_inputs_match_reference():
    """The wrappers' autograd path (saved gradient x incoming scalar) against the references' autograd, with a
    loss coefficient != 1 and gradients to logprob and ref_logprob."""
    g = torch.Generator().manual_seed(11)
    B, T = 6, 40
    m = torch.rand(B, T, generator=g) > 0.3
    lp0, ref0, adv, old = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 for _ in range(4))
    v0, ret = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    agg = O.Aggregation(mode="seq-mean-token-mean")

    def grads(fused):
        lp, ref, v = (x.clone().requires_grad_() for x in (lp0, ref0, v0))
        with O.backend("fused" if fused else "reference"):
            pg = O.policy_loss(lp, old, adv, m, "vanilla", agg=agg).loss
            kl = O.kl_loss(lp, ref, m, "low_var_kl", agg)
            vf = O.value_loss(v, v0 + 0.1, ret, m, 0.2, agg=agg).loss
        (-2.5 * pg + 0.3 * kl + 0.7 * vf).backward()
        return lp.grad, ref.grad, v.grad

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@needs_ext
def test_opcheck():
    B, T = 3, 5
    g = torch.Generator().manual_seed(7)
    r = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    x = r().requires_grad_()
    m = torch.rand(B, T, generator=g) > 0.3
    rw = torch.rand(B, dtype=torch.float64)
    one = torch.tensor(1.0)
    idx = torch.tensor([4, 4, 9])
    agg = ("seq-mean-token-mean", None, None, 1, None)
    checks = [
        (torch.ops.verl.gae.default, (r(), r(), m, 0.99, 0.95)),
        (torch.ops.verl.gae.default, (r(), None, m.float(), 0.9, 1.0)),
        (torch.ops.verl.outcome_advantage.default, (r(), m, idx, "grpo", 1e-6, True, None)),
        (torch.ops.verl.outcome_advantage.default, (r(), m, idx, "remax", 1e-6, True, torch.randn(B))),
        (torch.ops.verl.kl_penalty.default, (x, r(), "low_var_kl")),
        (torch.ops.verl.kl_penalty_backward.default, (r(), r(), r(), "abs")),
        (torch.ops.verl.gae.default, (r(), r(), m, 0.99, 0.95, 1e-8)),
        (torch.ops.verl.gae.default, (r(), None, m.float(), 0.9, 1.0, 0.0)),
        (torch.ops.verl.agg_loss.default, (x, m) + agg),
        (torch.ops.verl.agg_loss_backward.default, (one, m, rw)),
        (torch.ops.verl.kl_loss.default, (r(), r(), m, "k3+") + agg + (False,)),
        (torch.ops.verl.kl_loss.default, (x, r().requires_grad_(), m, "low_var_kl") + agg + (True,)),
        (torch.ops.verl.policy_loss.default, (x, r(), r(), m, "vanilla", 0.2, 0.28, 3.0) + agg + (True,)),
        (torch.ops.verl.policy_loss.default, (x, r(), r(), m, "gspo", 0.2, 0.28, 3.0, "token-mean", 30.0, 6.0, 2,
                                              None, True)),
        (torch.ops.verl.policy_loss.default, (r(), r(), r(), m, "reinforce", 0.2, 0.2, 3.0) + agg + (False,)),
        (torch.ops.verl.value_loss.default, (x, r(), r(), m, 0.5) + agg + (True,)),
        (torch.ops.verl.value_loss.default, (r(), r(), r(), m, 0.5) + agg + (False,)),
        (torch.ops.verl.loss_grad_scale.default, (one, r())),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


@needs_ext
def test_torch_compile_fullgraph_whole_ppo_loss():
    """Advantages, policy loss, KL loss, value loss and entropy bonus in one fullgraph-compiled function."""
    g = torch.Generator().manual_seed(8)
    B, T = 8, 16
    m = torch.rand(B, T, generator=g) > 0.2
    index = torch.arange(B) // 4
    rewards = torch.randn(B, T, generator=g)
    old, ref, ent = (torch.randn(B, T, generator=g) * 0.1 for _ in range(3))
    old_v, values0 = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    agg = O.Aggregation(mode="token-mean", global_tokens=float(m.sum()) * 2, dp_size=2)

    def step(logprob, values):
        grpo = O.outcome_advantage(rewards, m, index, "grpo", check_finite=False)
        gae = O.compute_gae(rewards, old_v, m, 0.99, 0.95, check_finite=False)
        pg = O.policy_loss(logprob, old, grpo.advantages, m, "vanilla", clip_high=0.28, agg=agg)
        vf = O.value_loss(values, old_v, gae.returns, m, 0.5, agg=agg)
        kl = O.kl_loss(logprob, ref, m, "low_var_kl", agg)
        return pg.loss + 0.001 * kl + 0.5 * vf.loss - 0.01 * O.agg_loss(ent * logprob, m, agg), pg.pg_clipfrac

    lp = (old + 0.05 * torch.randn(B, T, generator=g)).requires_grad_()
    v = values0.clone().requires_grad_()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, cf = compiled(lp, v)
    got.backward()
    g_lp, g_v = lp.grad.clone(), v.grad.clone()
    lp.grad = v.grad = None
    want, cf_want = step(lp, v)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cf, cf_want)
    torch.testing.assert_close(g_lp, lp.grad)
    torch.testing.assert_close(g_v, v.grad)


# ---------------------------------------------------------------------------------------------- edge and bad inputs

@needs_ext
def test_all_zero_mask_gives_zero_losses_and_advantages():
    x = torch.randn(4, 6, requires_grad=True)
    none = torch.zeros(4, 6, dtype=torch.bool)
    for mode in O.AGG_MODES:
        out = O.policy_loss(x, x.detach() + 0.1, torch.randn(4, 6), none, agg=mode)
        assert out.loss.item() == 0.0 and out.pg_clipfrac.item() == 0.0 and out.ppo_kl.item() == 0.0
        out.loss.backward()
        assert torch.equal(x.grad, torch.zeros(4, 6))
        assert O.value_loss(x, x.detach(), x.detach() + 1, none, agg=mode).loss.item() == 0.0
        assert O.agg_loss(x, none, mode).item() == 0.0
    gae = O.compute_gae(torch.randn(4, 6), torch.randn(4, 6), none, 0.9, 0.9)
    assert torch.equal(gae.advantages, torch.zeros(4, 6)) and torch.equal(gae.returns, torch.zeros(4, 6))
    grpo = O.outcome_advantage(torch.randn(4, 6), none, [0, 0, 1, 1])
    assert torch.equal(grpo.advantages, torch.zeros(4, 6))


@needs_ext
def test_nonfinite_rewards_are_reported_not_propagated_silently():
    r = torch.randn(4, 5)
    m = torch.ones(4, 5, dtype=torch.bool)
    r[1, 2] = float("nan")
    r[3, 0] = float("inf")
    with pytest.raises(VerlRuntimeError, match="2 NaN/inf"):
        O.compute_gae(r, torch.zeros(4, 5), m, 1.0, 1.0)
    with pytest.raises(VerlRuntimeError, match="2 NaN/inf"):
        O.outcome_advantage(r, m, [0, 0, 1, 1], "grpo")
    assert int(O.compute_gae(r, None, m, 1.0, 1.0, check_finite=False).num_nonfinite) == 2
    m[1, 2] = False  # a NaN under the mask is padding: ignored, not counted
    assert int(torch.ops.verl.gae(r, None, m, 1.0, 1.0)[2]) == 1
    assert int(torch.ops.verl.outcome_advantage(r, m, torch.tensor([0, 0, 1, 1]), "rloo", 1e-6, True, None)[1]) == 1


@needs_ext
def test_bad_inputs_name_the_argument():
    x = torch.randn(3, 4)
    m = torch.ones(3, 4, dtype=torch.bool)
    idx = torch.tensor([0, 0, 1])
    agg = ("token-mean", None, None, 1, None)
    with pytest.raises(RuntimeError, match=r"`mask` must have the shape of `rewards`"):
        torch.ops.verl.gae(x, x, torch.ones(4, 3), 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"`values` must have the shape of `rewards`"):
        torch.ops.verl.gae(x, torch.randn(3, 5), m, 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"`mask` must be bool or a real dtype"):
        torch.ops.verl.policy_loss(x, x, x, m.to(torch.complex64), "vanilla", 0.2, 0.2, 3.0, *agg, False)
    with pytest.raises(RuntimeError, match=r"`index` must be 1-D with one prompt id per sequence \(B=3\)"):
        torch.ops.verl.outcome_advantage(x, m, torch.tensor([0, 1]), "grpo", 1e-6, True, None)
    with pytest.raises(RuntimeError, match=r"`index` .* must be an integer tensor"):
        torch.ops.verl.outcome_advantage(x, m, torch.tensor([0.0, 1.0, 2.0]), "grpo", 1e-6, True, None)
    with pytest.raises(ValueError, match=r"one prompt id per sequence \(B=3\)"):
        O.outcome_advantage(x, m, np.array([0, 1]))
    with pytest.raises(RuntimeError, match="unknown aggregation `mode` 'token_mean'; known modes: token-mean, "):
        torch.ops.verl.agg_loss(x, m, "token_mean", None, None, 1, None)
    with pytest.raises(VerlConfigError, match=r"did you mean 'token-mean'.*known: token-mean, seq-mean-token-sum"):
        O.agg_loss(x, m, "token_mean")
    with pytest.raises(RuntimeError, match=r"unknown KL `kind` 'k4'; known kinds: kl \(k1\)"):
        torch.ops.verl.kl_penalty(x, x, "k4")
    with pytest.raises(RuntimeError, match="unknown policy `loss_type` 'ppo2'; known types: vanilla, gspo"):
        torch.ops.verl.policy_loss(x, x, x, m, "ppo2", 0.2, 0.2, 3.0, *agg, False)
    with pytest.raises(RuntimeError, match="unknown outcome `estimator` 'grpo2'"):
        torch.ops.verl.outcome_advantage(x, m, idx, "grpo2", 1e-6, True, None)
    with pytest.raises(RuntimeError, match=r"`rewards` is empty .* an empty batch"):
        torch.ops.verl.gae(torch.empty(0, 4), None, torch.empty(0, 4, dtype=torch.bool), 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"`logprob` must be 2-D \[B, T\]"):
        torch.ops.verl.kl_loss(torch.randn(12), torch.randn(12), torch.ones(12), "kl", *agg, True)
    with pytest.raises(RuntimeError, match=r"`old_logprob` must have the dtype of `logprob`"):
        torch.ops.verl.policy_loss(x, x.double(), x, m, "vanilla", 0.2, 0.2, 3.0, *agg, True)
    with pytest.raises(RuntimeError, match=r"`clip_c` \(dual-clip constant\) must be > 1"):
        torch.ops.verl.policy_loss(x, x, x, m, "vanilla", 0.2, 0.2, 0.5, *agg, False)
    with pytest.raises(RuntimeError, match=r"`dp_size` must be >= 1"):
        torch.ops.verl.agg_loss(x, m, "token-mean", None, None, 0, None)
    with pytest.raises(RuntimeError, match=r"`gamma` must be in \[0, 1\]"):
        torch.ops.verl.gae(x, None, m, 1.5, 1.0)
    with pytest.raises(RuntimeError, match=r"`whiten_eps` must be >= 0"):
        torch.ops.verl.gae(x, None, m, 1.0, 1.0, -1.0)
    with pytest.raises(RuntimeError, match=r"`clip` \(value clip range\) must be >= 0"):
        torch.ops.verl.value_loss(x, x, x, m, -0.1, *agg, True)
    with pytest.raises(RuntimeError, match=r"estimator 'remax' needs `baseline`"):
        torch.ops.verl.outcome_advantage(x, m, idx, "remax", 1e-6, True, None)
    with pytest.raises(RuntimeError, match=r"`row_weight` must be the float64 \[B\] output"):
        torch.ops.verl.agg_loss_backward(torch.tensor(1.0), m, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"agg_loss_backward: `grad` must be the gradient of the scalar loss"):
        torch.ops.verl.agg_loss_backward(torch.ones(2), m, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Aggregation.dp_size must be >= 1"):
        O.Aggregation(dp_size=0)


def test_reference_backend_runs_without_kernels():
    r, m = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) > 0.3
    with O.backend("reference"):
        a = O.outcome_advantage(r, m, ["u1", "u1", "u2", "u2"], "grpo")
        p = O.policy_loss(r, r + 0.1, a.advantages, m, agg="seq-mean-token-sum")
    want, _ = O.outcome_advantage_ref(r, m, torch.tensor([0, 0, 1, 1]), "grpo")
    torch.testing.assert_close(a.advantages, want)
    assert torch.isfinite(p.loss)


@needs_ext
def test_dispatcher_has_cpu_kernels_for_rl_ops():
    rl_ops = ["gae", "outcome_advantage", "kl_penalty", "kl_penalty_backward", "agg_loss", "agg_loss_backward",
              "kl_loss", "policy_loss", "value_loss", "loss_grad_scale"]
    missing = [op for op in rl_ops if not _extension.has_kernel(op, "CPU")]
    assert not missing
