"""verl::linear_rl_loss (the fused RL loss head): against an independent float64 reference written here (full
logits, log_softmax, the PPO / GSPO / REINFORCE formulas, every KL kind, every aggregation), gradients, hypothesis
properties (masks with holes, fully padded rows, extreme ratios on every clip branch), opcheck, torch.compile,
bad inputs on both backends, and the vocab-parallel path on 2 gloo ranks.

Tolerances: float64 1e-10 (the kernel uses std::exp and double accumulation); float32 2e-5 relative-ish (the
polynomial exp and float GEMMs).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl.ops as O
from tests.conftest import devices
from verl import _extension
from verl.ops.losses import Aggregation
from verl.testing import run_distributed
from tests.conftest import needs_ext

pytestmark = needs_ext
OPS = torch.ops.verl if _extension.available() else None
FAST = settings(max_examples=12, deadline=None, derandomize=True)
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
KINDS = ("k1", "abs", "k2", "k3", "k1+", "k3+")
STATS_TOL = 2e-6  # the statistics output is float32


# ------------------------------------------------------------------------------- independent float64 reference

def _kl64(lp, ref, kind):
    """Per-token KL estimate, differentiable in lp; the "+" kinds carry k1 / k3's value with k2's gradient."""
    d = lp - ref
    k2 = 0.5 * d * d
    if kind in ("k1", "k1+"):
        return d if kind == "k1" else d.detach() + (k2 - k2.detach())
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return k2
    dr = ref - lp
    k3 = (dr.clamp(-20, 20).exp() - dr.clamp(-20, 20) - 1).clamp(-10, 10)
    return k3 if kind == "k3" else k3.detach() + (k2 - k2.detach())


def _pg64(lp, old, adv, mask, loss_type, lo, hi, c):
    """Per-token PPO-family loss [B, T] as a differentiable function of lp (autograd gives its gradient)."""
    valid = mask != 0
    if loss_type == "gspo":
        seq = torch.where(valid, lp - old, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        log_ratio = lp - lp.detach() + seq.detach()[:, None]
    else:
        log_ratio = lp - old
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    if loss_type == "reinforce":
        return -adv * ratio, torch.zeros_like(adv), torch.zeros_like(adv)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - lo, 1 + hi)
    per = torch.maximum(unclipped, clipped)
    frac = (clipped > unclipped).double()
    lower = torch.zeros_like(adv)
    if loss_type == "vanilla":
        per = torch.where(adv < 0, torch.minimum(per, -adv * c), per)
        lower = ((torch.maximum(unclipped, clipped) > -adv * c) & (adv < 0)).double()
    return per, frac, lower


def _row_weights(mask, mode, T):
    valid = mask != 0
    count = valid.sum(-1).double()
    tokens, seqs = count.sum(), (count > 0).sum().double()
    w = {"token-mean": 1 / tokens.clamp(min=1) + 0 * count, "seq-mean-token-sum": 1 / seqs.clamp(min=1) + 0 * count,
         "seq-mean-token-mean": 1 / (seqs.clamp(min=1) * count.clamp(min=1)),
         "seq-mean-token-sum-norm": 1 / (seqs.clamp(min=1) * T) + 0 * count, "token-sum": torch.ones_like(count)}[mode]
    return torch.where(count > 0, w, 0.0)


def reference64(h, w, y, mask, adv, old, ref, t, loss_type, lo, hi, c, kind, kc, ec, mode):
    """(loss, stats [8], lp, ent, grad_h, grad_w) in float64 from the full logits."""
    h = h.double().detach().requires_grad_()
    w = w.double().detach().requires_grad_()
    B, T = mask.shape
    logp = torch.log_softmax((h @ w.t()) / t, -1)
    valid = mask != 0
    lp = logp.gather(-1, y.reshape(-1, 1).long().clamp(0, w.shape[0] - 1)).view(B, T)
    ent = -(logp.exp() * logp).sum(-1).view(B, T)
    lp, ent = torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)
    o = lp.detach() if old is None else old.double()
    per, frac, lower = _pg64(lp, o, adv.double(), mask, loss_type, lo, hi, c)
    rw = _row_weights(mask, mode, T)[:, None] * valid.double()
    pg_loss, ent_loss = (rw * per).sum(), (rw * ent).sum()
    n = valid.sum().clamp(min=1)
    loss, kl_loss, kl_mean = pg_loss - ec * ent_loss, torch.zeros(()), torch.zeros(())
    if ref is not None:
        kl_mean = torch.where(valid, lp.detach() - ref.double(), 0.0).sum() / n
        if kc:
            kl_loss = (rw * _kl64(lp, ref.double(), kind)).sum()
            loss = loss + kc * kl_loss
    gh, gw = torch.autograd.grad(loss, (h, w))
    m = valid.double()
    stats = torch.stack([pg_loss.detach(), kl_loss.detach().double(), ent_loss.detach(), (frac * m).sum() / n,
                         (lower * m).sum() / n, (-(lp.detach() - o).clamp(-20, 20) * m).sum() / n,
                         (ent.detach() * m).sum() / n, kl_mean.double()])
    return loss.detach(), stats, lp.detach(), ent.detach(), gh, gw


# ------------------------------------------------------------------------------------------------ samples

def sample_problem(B, T, H, V, seed, dtype=torch.float64, device="cpu", holes=True, ratio_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sc).to(dtype)  # noqa: E731
    h, w = r(B * T, H), r(V, H, sc=0.7)
    y = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    if holes:
        mask[torch.rand(B, T, generator=g) < 0.3] = 0
        mask[0] = 0  # a fully padded sequence
        y[0, 0] = -5  # its labels are never read
    with torch.no_grad():
        lp = torch.log_softmax(h.double() @ w.double().t(), -1).gather(-1, y.clamp(min=0).reshape(-1, 1)).view(B, T)
    old = (lp + r(B, T, sc=ratio_scale).double()).to(dtype)
    ref = (lp + r(B, T, sc=ratio_scale).double()).to(dtype)
    adv = r(B, T)
    return [x.to(device) for x in (h, w, y, mask, adv, old, ref)]


def _fused(h, w, y, mask, adv, old, ref, t, lt, lo, hi, c, kind, kc, ec, mode, chunk_n=3, with_grad=True,
           grad_weight=True):
    return OPS.linear_rl_loss(h, w, y, mask, adv, old, ref, t, lt, lo, hi, c, kind, kc, ec, mode, None, None, 1, None,
                              chunk_n, with_grad, grad_weight)


def _close(got, want, tol):
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.allclose(got, want, rtol=tol, atol=tol), f"max |diff| {float((got - want).abs().max())}"


CASES = [("vanilla", "k3", "token-mean", 0.8), ("vanilla", "k1", "seq-mean-token-mean", 1.0),
         ("gspo", "abs", "seq-mean-token-sum", 1.3), ("reinforce", "k2", "seq-mean-token-sum-norm", 0.7),
         ("vanilla", "k3+", "token-sum", 1.0), ("gspo", "k1+", "token-mean", 0.9)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lt,kind,mode,t", CASES)
def test_matches_float64_reference(device, dtype, lt, kind, mode, t):
    p = sample_problem(4, 5, 8, 37, seed=1, dtype=dtype, device=device)
    args = (t, lt, 0.2, 0.28, 3.0, kind, 0.3, 0.05, mode)
    got = _fused(*p, *args)
    want = reference64(*p, *args)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for i, (g, wv) in enumerate(zip(got, want)):
        _close(g, wv, max(tol, STATS_TOL) if i == 1 else tol)


@pytest.mark.parametrize("chunk_n", [1, 2, 7, 0])
def test_chunking_and_on_policy_do_not_change_the_result(chunk_n):
    """Every chunk size (GSPO cuts at sequence ends; 0 = auto) gives the same numbers; old=None is ratio 1."""
    p = sample_problem(5, 4, 6, 29, seed=2)
    for lt in ("vanilla", "gspo"):
        base = _fused(*p, 1.0, lt, 0.2, 0.2, 3.0, "k3", 0.1, 0.01, "token-mean", chunk_n=100)
        got = _fused(*p, 1.0, lt, 0.2, 0.2, 3.0, "k3", 0.1, 0.01, "token-mean", chunk_n=chunk_n)
        for a, b in zip(got, base):
            _close(a, b, 1e-12)
    h, w, y, mask, adv, _, ref = p
    on = _fused(h, w, y, mask, adv, None, ref, 1.0, "vanilla", 0.2, 0.2, 3.0, "k3", 0.0, 0.0, "token-mean")
    want = reference64(h, w, y, mask, adv, None, ref, 1.0, "vanilla", 0.2, 0.2, 3.0, "k3", 0.0, 0.0, "token-mean")
    for i, (a, b) in enumerate(zip(on, want)):
        _close(a, b, STATS_TOL if i == 1 else 1e-10)
    assert float(on[1][3]) == 0.0 and float(on[1][5]) == 0.0  # ratio 1: nothing clipped, ppo_kl 0


def test_wrapper_autograd_and_backend_switch():
    """verl.ops.linear_rl_loss on [B, T, H]: fused and reference backends agree; backward scales by grad_output."""
    h, w, y, mask, adv, old, ref = sample_problem(3, 4, 6, 31, seed=3, dtype=torch.float32)
    kw = dict(old_logprob=old, ref_logprob=ref, temperature=0.9, loss_type="vanilla", clip_low=0.2, clip_high=0.3,
              kl_coef=0.2, entropy_coeff=0.01, agg=Aggregation(mode="token-mean", global_tokens=20.0, dp_size=2))
    res = {}
    for mode in ("fused", "reference"):
        hh, ww = h.view(3, 4, 6).clone().requires_grad_(), w.clone().requires_grad_()
        with O.backend(mode):
            out = O.linear_rl_loss(hh, ww, y, mask, adv, **kw)
        (3.0 * out.loss).backward()
        res[mode] = (out, hh.grad, ww.grad)
    (a, ga, gwa), (b, gb, gwb) = res["fused"], res["reference"]
    for x, z in zip(a, b):
        _close(x, z, 2e-5)
    _close(ga, gb, 2e-5)
    _close(gwa, gwb, 2e-5)
    with torch.no_grad():  # no autograd: no gradient work, same loss
        nog = OPS.linear_rl_loss(h, w, y, mask, adv, old, ref, 0.9, "vanilla", 0.2, 0.3, 3.0, "k3", 0.2, 0.01,
                                 "token-mean", 20.0, None, 2, None, 0, False)
    _close(nog[0], a.loss, 1e-7)
    assert nog[4].numel() == 0 and nog[5].numel() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_frozen_head_skips_grad_weight_and_changes_nothing_else(device, dtype):
    """A head that does not require grad (LoRA's) costs no grad_weight GEMM: the op returns an empty grad_weight and
    every other output bit for bit as with it; the wrapper asks for it only when the weight requires grad, and
    autograd refuses a weight gradient from a call that skipped it instead of returning nothing."""
    h, w, y, mask, adv, old, ref = sample_problem(3, 5, 8, 37, seed=5, dtype=dtype, device=device)
    args = (0.9, "vanilla", 0.2, 0.28, 3.0, "k3", 0.2, 0.01, "token-mean")
    both = _fused(h, w, y, mask, adv, old, ref, *args)
    frozen = _fused(h, w, y, mask, adv, old, ref, *args, grad_weight=False)
    assert both[5].shape == w.shape and frozen[5].numel() == 0
    for a, b in zip(frozen[:5], both[:5]):
        assert torch.equal(a, b)
    kw = dict(old_logprob=old, ref_logprob=ref, temperature=0.9, clip_high=0.28, kl_coef=0.2, entropy_coeff=0.01)
    grads = []
    for head in (w, w.clone().requires_grad_()):  # frozen, then trained
        hh = h.clone().requires_grad_()
        O.linear_rl_loss(hh, head, y, mask, adv, **kw).loss.backward()
        grads.append(hh.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = OPS.linear_rl_loss(hh, ww, y, mask, adv, old, ref, *args, None, None, 1, None, 3, True, False)[0]
    with pytest.raises(RuntimeError, match="called with grad_weight=False"):
        loss.backward()


def test_non_contiguous_inputs_give_the_same_result():
    h, w, y, mask, adv, old, ref = sample_problem(3, 4, 6, 31, seed=4)
    want = _fused(h, w, y, mask, adv, old, ref, 1.0, "vanilla", 0.2, 0.2, 3.0, "k3", 0.1, 0.0, "token-mean")
    hs = torch.stack([h, h], -1)[..., 0]  # strided views of the same numbers
    ws = torch.stack([w, w], -1)[..., 0]
    assert not hs.is_contiguous() and not ws.is_contiguous()
    advs, masks = adv.t().contiguous().t(), mask.t().contiguous().t()
    got = _fused(hs, ws, y.t().contiguous().t(), masks, advs, old, ref, 1.0, "vanilla", 0.2, 0.2, 3.0, "k3", 0.1, 0.0,
                 "token-mean")
    for a, b in zip(got, want):
        _close(a, b, 0.0)


# ------------------------------------------------------------------------------------------------ properties

@st.composite
def rl_cases(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    holes = draw(st.booleans())
    scale = draw(st.sampled_from([0.05, 1.0, 30.0]))  # 30: log-ratios past the +-20 clamp, every clip branch
    lt = draw(st.sampled_from(["vanilla", "gspo", "reinforce"]))
    kind = draw(st.sampled_from(KINDS))
    mode = draw(st.sampled_from(MODES))
    return B, T, seed, holes, scale, lt, kind, mode


@FAST
@given(rl_cases())
def test_property_matches_reference(case):
    B, T, seed, holes, scale, lt, kind, mode = case
    p = sample_problem(B, T, 5, 23, seed=seed, holes=holes, ratio_scale=scale)
    args = (1.0, lt, 0.2, 0.28, 3.0, kind, 0.5, 0.02, mode)
    got = _fused(*p, *args, chunk_n=1 + seed % 5)
    want = reference64(*p, *args)
    for i, (g, wv) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        _close(g, wv, STATS_TOL if i == 1 else 1e-9)
    mask = p[3]
    assert (got[2][mask == 0] == 0).all() and (got[3][mask == 0] == 0).all()
    dead = (mask == 0).reshape(-1)
    assert (got[4][dead] == 0).all()  # masked tokens get no gradient


def test_fully_padded_batch_gives_zero_and_no_nan():
    h, w, y, mask, adv, old, ref = sample_problem(2, 3, 4, 11, seed=5)
    mask.zero_()
    y.fill_(-1)  # never read
    out = _fused(h, w, y, mask, adv, old, ref, 1.0, "gspo", 0.2, 0.2, 3.0, "k3", 0.1, 0.1, "seq-mean-token-mean")
    assert float(out[0]) == 0.0 and (out[1] == 0).all() and (out[4] == 0).all() and (out[5] == 0).all()


# ------------------------------------------------------------------------------------------------ torch.library

@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    h, w, y, mask, adv, old, ref = sample_problem(3, 4, 6, 19, seed=6, dtype=torch.float32, device=device)
    h.requires_grad_()
    w.requires_grad_()
    for with_grad in (True, False):
        args = (h, w, y, mask, adv, old, ref, 0.9, "vanilla", 0.2, 0.28, 3.0, "k3", 0.1, 0.01, "token-mean", None,
                None, 1, None, 2, with_grad)
        tests = ("test_schema", "test_faketensor") if not with_grad else None
        if tests:
            torch.library.opcheck(OPS.linear_rl_loss.default, args, test_utils=tests)
        else:
            torch.library.opcheck(OPS.linear_rl_loss.default, args)


def test_torch_compile_fullgraph():
    h, w, y, mask, adv, old, ref = sample_problem(2, 5, 6, 40, seed=7, dtype=torch.float32)

    def loss(hh, ww):
        out = O.linear_rl_loss(hh, ww, y, mask, adv, old_logprob=old, ref_logprob=ref, temperature=0.8,
                               kl_coef=0.1, entropy_coeff=0.01, chunk_n=3)
        return out.loss * 2 + out.pg_clipfrac

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(hh, ww)
    g1 = torch.autograd.grad(got, (hh, ww))
    want = loss(hh, ww)
    g2 = torch.autograd.grad(want, (hh, ww))
    torch.testing.assert_close(got, want)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------ bad input

def _bad_cases():
    h, w, y, mask, adv, old, ref = sample_problem(2, 3, 4, 10, seed=8, dtype=torch.float32, holes=False)
    base = dict(hidden=h, weight=w, labels=y, mask=mask, advantages=adv, old=old, ref=ref, t=1.0, lt="vanilla",
                kind="k3", chunk_n=0, clip_low=0.2)
    cases = [
        (dict(hidden=h[:5]), ValueError, r"`hidden` has N=5 rows but `mask` is \[B, T\]"),
        (dict(weight=w.double()), TypeError, r"`weight` has dtype"),
        (dict(weight=torch.randn(10, 5)), ValueError, r"`weight` \[V, H\] has H=5"),
        (dict(labels=y.float()), TypeError, r"`labels` must be int64 or int32"),
        (dict(labels=y[:, :2]), ValueError, r"`labels` must have the shape of `mask`"),
        (dict(labels=torch.full_like(y, 10)), ValueError, r"`labels`\[0, 0\] = 10 is a valid \(mask != 0\) token "
                                                          r"outside the vocabulary \[0, 10\)"),
        (dict(mask=mask[None]), ValueError, r"`mask` must be 2-D"),
        (dict(advantages=adv.long()), TypeError, r"`advantages` must be a floating-point tensor"),
        (dict(advantages=adv[:, :2]), ValueError, r"`advantages` must have the shape of `mask`"),
        (dict(old=old[:1]), ValueError, r"`old_logprob` must have the shape of `mask`"),
        (dict(ref=ref.int()), TypeError, r"`ref_logprob` must be a floating-point tensor"),
        (dict(hidden=h.long()), TypeError, r"`hidden` must be a floating-point tensor"),
        (dict(t=0.0), ValueError, r"`temperature` must be a finite number > 0"),
        (dict(chunk_n=-1), ValueError, r"`chunk_n` must be >= 0"),
        (dict(clip_low=1.5), ValueError, r"`clip_low` must be in \[0, 1\)"),
    ]
    return base, cases


def _call_wrapper(a):
    return O.linear_rl_loss(a["hidden"], a["weight"], a["labels"], a["mask"], a["advantages"], old_logprob=a["old"],
                            ref_logprob=a["ref"], temperature=a["t"], loss_type=a["lt"], kl_kind=a["kind"],
                            chunk_n=a["chunk_n"], clip_low=a["clip_low"])


def _call_kernel(a):
    return OPS.linear_rl_loss(a["hidden"], a["weight"], a["labels"], a["mask"], a["advantages"], a["old"], a["ref"],
                              a["t"], a["lt"], a["clip_low"], 0.2, 3.0, a["kind"], 0.0, 0.0, "token-mean", None, None,
                              1, None, a["chunk_n"], True)


def test_bad_inputs_name_the_argument_on_both_backends_and_the_kernel():
    base, cases = _bad_cases()
    for change, err, pattern in cases:
        a = {**base, **change}
        for mode in ("fused", "reference"):
            with O.backend(mode), pytest.raises(err, match=pattern):
                _call_wrapper(a)
        arg = pattern.split("`")[1] if "`" in pattern else None
        with pytest.raises(RuntimeError, match=rf"linear_rl_loss: .*`{arg}`" if arg else pattern):
            _call_kernel(a)


def test_unknown_names_are_config_errors_listing_the_known_ones():
    from verl.errors import VerlConfigError
    base, _ = _bad_cases()
    with pytest.raises(VerlConfigError, match=r"unknown fused loss head policy loss 'cispo'.*vanilla, gspo"):
        _call_wrapper({**base, "lt": "cispo"})
    with pytest.raises(VerlConfigError, match=r"unknown KL kind 'k4'"):
        _call_wrapper({**base, "kind": "k4"})
    with pytest.raises(RuntimeError, match=r"policy `loss_type`"):
        _call_kernel({**base, "lt": "cispo"})


@pytest.mark.cuda
def test_device_mismatch_is_named():
    base, _ = _bad_cases()
    with pytest.raises(ValueError, match=r"`weight` is on cuda"):
        _call_wrapper({**base, "weight": base["weight"].cuda()})
    with pytest.raises(RuntimeError, match=r"`mask` is on"):
        _call_kernel({**{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in base.items()}, "mask": base["mask"]})


# ------------------------------------------------------------------------------------------------ vocab parallel

def _tp_body(rank, world):
    import torch.distributed as dist
    group = dist.new_group(list(range(world)))
    h, w, y, mask, adv, old, ref = sample_problem(4, 5, 6, 36, seed=9)
    y[1, 0], y[1, 1] = 0, 35  # first / last vocabulary entries: owned by rank 0 and the last rank
    vs = w.shape[0] // world
    out = {}
    for lt, mode, kind in (("vanilla", "token-mean", "k3"), ("gspo", "seq-mean-token-mean", "k1")):
        hh = h.clone().requires_grad_()
        ws = w[rank * vs:(rank + 1) * vs].clone().requires_grad_()
        res = O.vocab_parallel_linear_rl_loss(hh, ws, y, mask, adv, group, old_logprob=old, ref_logprob=ref,
                                              temperature=0.9, loss_type=lt, kl_kind=kind, kl_coef=0.2,
                                              entropy_coeff=0.03, agg=mode, chunk_n=7)
        (2.0 * res.loss).backward()
        out[lt] = (res, hh.grad, ws.grad)
    return out


def test_vocab_parallel_on_two_gloo_ranks_matches_the_single_rank_op():
    results = run_distributed(_tp_body, world_size=2)
    h, w, y, mask, adv, old, ref = sample_problem(4, 5, 6, 36, seed=9)
    y[1, 0], y[1, 1] = 0, 35
    for lt, mode, kind in (("vanilla", "token-mean", "k3"), ("gspo", "seq-mean-token-mean", "k1")):
        want = reference64(h, w, y, mask, adv, old, ref, 0.9, lt, 0.2, 0.2, 3.0, kind, 0.2, 0.03, mode)
        vs = w.shape[0] // 2
        for rank, res in enumerate(results):
            out, gh, gw = res[lt]
            _close(out.loss, want[0], 1e-10)
            for got, wv in zip(out[1:9], want[1]):
                _close(got, wv, STATS_TOL)
            _close(out.log_probs, want[2], 1e-10)
            _close(gh, 2 * want[4], 1e-10)
            _close(gw, 2 * want[5][rank * vs:(rank + 1) * vs], 1e-10)
    assert math.isfinite(float(results[0]["vanilla"][0].loss))


def test_backward_scales_in_place_and_a_second_backward_is_refused():
    """The backward scales the saved gradients in their own memory (no second [V, H] at the peak), so the graph
    cannot be backwarded twice; autograd says so instead of returning wrong gradients."""
    h, w, y, mask, adv, old, ref = sample_problem(2, 3, 4, 11, seed=10, dtype=torch.float32)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = O.linear_rl_loss(hh, ww, y, mask, adv, old_logprob=old, ref_logprob=ref)
    (2.0 * out.loss).backward(retain_graph=True)
    want = reference64(h, w, y, mask, adv, old, ref, 1.0, "vanilla", 0.2, 0.2, 3.0, "k3", 0.0, 0.0, "token-mean")
    _close(hh.grad, 2 * want[4], 2e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
