"""The policy losses, advantage estimators and aggregation added for issue #16, and rollout correction: each against
an independent float64 reference written here (per-element Python loops), values and gradients; Hypothesis
properties for padding, single-response groups and extreme ratios; and short trainer runs wiring each by config."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl.algos as A
import verl.ops as O
from verl.algos import pg_losses as P
from verl.algos.rollout_correction import is_weights, rejection_keep, rollout_correction
from verl.config import PPOConfig, load_config
from verl.config.ppo import RolloutCorrectionConfig
from verl.errors import VerlConfigError
from tests.conftest import needs_ext
from tests.trainer.conftest import tiny_args  # noqa: F401  (the tiny trainer job's overrides)

FAST = settings(max_examples=20, deadline=None, derandomize=True)
NEW_LOSSES = ("cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "dro")
# the reference's hyperparameters by the papers' names; CISPO, DPPO and GMPO take theirs from the actor's
# clip_ratio_low / high / c (as upstream verl does): CLIPS passes them that way
PARAMS = {"cispo": NS(clip_low=0.3, clip_high=0.28), "sapo": P.SAPOParams(tau_pos=1.0, tau_neg=1.05),
          "gpg": None, "dppo_tv": NS(threshold_low=0.1, threshold_high=0.05, is_cap=2.0),
          "dppo_kl": NS(threshold_low=0.02, threshold_high=0.05, is_cap=2.0),
          "clip_cov": P.ClipCovParams(clip_cov_ratio=0.3, cov_lb=0.0, cov_ub=5.0),
          "kl_cov": P.KLCovParams(kl_cov_ratio=0.3, ppo_kl_coef=0.7),
          "geo_mean": NS(clip_low=0.3, clip_high=0.2),
          "dro": P.DROParams(beta=0.3)}
CLIP = (0.2, 0.28)
CLIPS = {"cispo": dict(clip_low=0.3, clip_high=0.28), "dppo_tv": dict(clip_low=0.1, clip_high=0.05, clip_c=2.0),
         "dppo_kl": dict(clip_low=0.02, clip_high=0.05, clip_c=2.0), "geo_mean": dict(clip_low=0.3, clip_high=0.2)}
SEQ_LEVEL = ("geo_mean", "sapo")  # aggregated per sequence whatever the mode (as upstream verl)


def _extra(name) -> dict:
    """The loss's own params (a dataclass it declares), if any."""
    params = PARAMS[name]
    return {"params": params} if params is not None and not isinstance(params, NS) else {}


# ---------------------------------------------------------------------------------------------- the reference

def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_agg(per, valid, mode, tokens=None, seqs=None, dp=1, norm_len=None):
    """per: list of lists of 0-d float64 tensors (None where masked) -> 0-d tensor, by the documented formulas."""
    T = len(valid[0])
    rows = [[per[b][t] for t in range(T) if valid[b][t]] for b in range(len(valid))]
    n_tok = sum(len(r) for r in rows) if tokens is None else tokens
    n_seq = sum(1 for r in rows if r) if seqs is None else seqs
    zero = torch.zeros((), dtype=torch.float64)
    total = sum((x for r in rows for x in r), zero)
    if mode == "token-sum":
        out = total
    elif mode == "token-mean":
        out = total / n_tok if n_tok else zero
    elif mode == "seq-mean-token-sum":
        out = total / n_seq if n_seq else zero
    elif mode == "seq-mean-token-mean":
        out = sum((sum(r, zero) / len(r) for r in rows if r), zero) / n_seq if n_seq else zero
    else:
        out = total / (n_seq * (norm_len or T)) if n_seq else zero
    return out * dp


def _covs(lp, adv, valid):
    cells = [(b, t) for b in range(len(valid)) for t in range(len(valid[0])) if valid[b][t]]
    ma = sum(adv[b][t] for b, t in cells) / len(cells)
    ml = sum(float(lp[b][t].detach()) for b, t in cells) / len(cells)
    return {(b, t): (adv[b][t] - ma) * (float(lp[b][t].detach()) - ml) for b, t in cells}


def ref_loss(name, lp, old, adv, valid, params, w=None, mode="token-mean", seed=0):
    """lp: [B][T] 0-d float64 tensors requiring grad; old, adv, w: nested float lists. Returns (loss, clipfrac,
    lower, ppo_kl) with the statistics as floats. Written per element from the papers' formulas."""
    B, T = len(valid), len(valid[0])
    cells = [(b, t) for b in range(B) for t in range(T) if valid[b][t]]
    per = [[None] * T for _ in range(B)]
    hit, low = set(), set()
    lr = {(b, t): min(max(float(lp[b][t].detach()) - old[b][t], -20.0), 20.0) for b, t in cells}
    lr_t = {(b, t): torch.clamp(lp[b][t] - old[b][t], -20.0, 20.0) for b, t in cells}
    ppo_kl = -sum(lr.values()) / max(len(cells), 1)
    if name == "geo_mean":
        return _ref_gmpo(lp, old, adv, valid, params, w, lr, lr_t, ppo_kl)
    if name == "clip_cov":
        cov = _covs(lp, adv, valid)
        cand = [(b, t) for b, t in cells
                if not (-adv[b][t] * min(max(math.exp(lr[b, t]), 1 - CLIP[0]), 1 + CLIP[1])
                        > -adv[b][t] * math.exp(lr[b, t])) and params.cov_lb < cov[b, t] < params.cov_ub]
        n_cut = min(max(int(params.clip_cov_ratio * len(cells)), 1), len(cand)) if cells else 0
        torch.manual_seed(seed)
        cut = {cand[i] for i in torch.randperm(len(cand))[:n_cut].tolist()}
    if name == "kl_cov" and cells:
        cov = _covs(lp, adv, valid)
        k = max(int(params.kl_cov_ratio * len(cells)), 1)
        top = set(sorted(cells, key=lambda c: -cov[c])[:k])
    for b, t in cells:
        a, x, r = adv[b][t], lp[b][t], math.exp(lr[b, t])
        if name == "cispo":
            wt = min(max(r, 1 - params.clip_low), 1 + params.clip_high)
            per[b][t] = -wt * a * x
            (hit if r > 1 + params.clip_high else low if r < 1 - params.clip_low else set()).add((b, t))
        elif name == "sapo":
            tau = params.tau_pos if a > 0 else params.tau_neg
            rt = torch.exp(lr_t[b, t])
            per[b][t] = -a * torch.sigmoid(tau * (rt - 1)) * 4 / tau
        elif name == "gpg":
            per[b][t] = -a * x
        elif name in ("dppo_tv", "dppo_kl"):
            p, q = math.exp(float(x.detach())), math.exp(old[b][t])
            if name == "dppo_tv":
                keep = (p - q <= params.threshold_high) if a > 0 else (p - q >= -params.threshold_low)
            else:
                kl = q * (old[b][t] - float(x.detach())) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                keep = (kl <= params.threshold_high or p <= q) if a > 0 else (kl <= params.threshold_low or p >= q)
            per[b][t] = -a * min(r, params.is_cap) * x * float(keep)
            (low if keep and r > params.is_cap else hit if not keep else set()).add((b, t))
        elif name == "clip_cov":
            rt = torch.exp(lr_t[b, t])
            v = torch.maximum(-a * rt, -a * torch.clamp(rt, 1 - CLIP[0], 1 + CLIP[1]))
            per[b][t] = v * 0.0 if (b, t) in cut else v
            if (b, t) in cut:
                hit.add((b, t))
        elif name == "kl_cov":
            v = -a * torch.exp(lr_t[b, t])
            per[b][t] = v + params.ppo_kl_coef * lr_t[b, t].abs() if (b, t) in top else v
        elif name == "dro":
            per[b][t] = -(a * x - 0.5 * params.beta * (x - old[b][t]) ** 2)
        if w is not None:
            per[b][t] = per[b][t] * w[b][t]
    n = max(len(cells), 1)
    if name == "kl_cov":
        ppo_kl = sum(abs(v) for v in lr.values()) / n
    return ref_agg(per, valid, mode), len(hit) / n, len(low) / n, ppo_kl


def _ref_gmpo(lp, old, adv, valid, params, w, lr, lr_t, ppo_kl):
    B, T = len(valid), len(valid[0])
    total, seqs, hi, lo, n_tok = torch.zeros((), dtype=torch.float64), 0, 0, 0, 0
    for b in range(B):
        ts = [t for t in range(T) if valid[b][t]]
        n_tok += len(ts)
        if not ts:
            continue
        seqs += 1
        terms = []
        for t in ts:
            a = adv[b][t]
            clipped_hi, clipped_lo = lr[b, t] > params.clip_high, lr[b, t] < -params.clip_low
            # the clip binds only against the advantage's direction: A > 0 caps growth, A < 0 caps shrinkage
            if a == 0:  # sign(0) = 0: a token without advantage contributes log-ratio 0
                terms.append(lr_t[b, t] * 0)
            elif a > 0 and clipped_hi:
                terms.append(lr_t[b, t] * 0 + params.clip_high)
            elif a < 0 and clipped_lo:
                terms.append(lr_t[b, t] * 0 - params.clip_low)
            else:
                terms.append(lr_t[b, t])
            hi += (clipped_hi or clipped_lo) and a > 0
            lo += (clipped_hi or clipped_lo) and a < 0
        seq = -(sum(adv[b][t] for t in ts) / len(ts)) * torch.exp(sum(terms) / len(ts))
        if w is not None:
            seq = seq * math.exp(sum(math.log(w[b][t]) for t in ts) / len(ts))
        total = total + seq
    n = max(n_tok, 1)
    return (total / seqs if seqs else total), hi / n, lo / n, ppo_kl


# ---------------------------------------------------------------------------------------------- inputs

def _case(B, T, seed, spread=1.5, holes=True, padded_row=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > (0.3 if holes else 0.0)
    mask[0, 0] = True
    if padded_row and B > 1:
        mask[-1] = False
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.01
    old = (lp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[torch.rand(B, T, generator=g) < 0.1] = 0.0
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


def _run(name, lp, old, adv, mask, agg="token-mean", w=None, seed=0):
    x = lp.clone().requires_grad_()
    torch.manual_seed(seed)
    clips = CLIPS.get(name, dict(clip_low=CLIP[0], clip_high=CLIP[1]))
    out = A.get_policy_loss(name)(x, old, adv, mask, agg=agg, rollout_is_weights=w, **clips, **_extra(name))
    out.loss.backward()
    return out, x.grad


def _reference(name, lp, old, adv, mask, mode="token-mean", w=None, seed=0):
    B, T = lp.shape
    cells = [[lp[b, t].double().clone().requires_grad_() for t in range(T)] for b in range(B)]
    valid = mask.tolist()
    loss, cf, lower, kl = ref_loss(name, cells, old.double().tolist(), adv.double().tolist(), valid, PARAMS[name],
                                   None if w is None else w.double().tolist(), mode, seed)
    grad = torch.zeros(B, T, dtype=torch.float64)
    if loss.requires_grad:
        flat = [c for row in cells for c in row]
        gs = torch.autograd.grad(loss, flat, allow_unused=True)
        grad = torch.tensor([0.0 if g is None else float(g) for g in gs], dtype=torch.float64).view(B, T)
    return loss, grad, cf, lower, kl


def _check(name, lp, old, adv, mask, mode="token-mean", w=None, seed=0, tol=1e-9):
    out, grad = _run(name, lp, old, adv, mask, mode, w, seed)
    loss, rgrad, cf, lower, kl = _reference(name, lp, old, adv, mask, mode, w, seed)
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), rgrad, rtol=tol, atol=tol)
    torch.testing.assert_close(out.pg_clipfrac.double(), torch.tensor(cf, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.pg_clipfrac_lower.double(), torch.tensor(lower, dtype=torch.float64), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(out.ppo_kl.double(), torch.tensor(kl, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    return out, grad


# ---------------------------------------------------------------------------------------------- losses

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", NEW_LOSSES)
def test_loss_matches_float64_reference_values_and_gradients(name, mode):
    lp, old, adv, mask = _case(5, 7, seed=3)
    _check(name, lp, old, adv, mask, "seq-mean-token-mean" if name in SEQ_LEVEL else mode)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_rollout_is_weights_multiply_the_per_token_loss(name):
    lp, old, adv, mask = _case(4, 6, seed=5)
    w = torch.rand(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 + 0.1
    _check(name, lp, old, adv, mask, "seq-mean-token-mean" if name in SEQ_LEVEL else "token-mean", w=w)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "reinforce"])
def test_fused_losses_take_rollout_weights_through_the_advantage(name):
    """Scaling A by w > 0 is exactly weighting each token's loss by w for these losses."""
    lp, old, adv, mask = _case(4, 6, seed=9)
    w = torch.rand(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.2
    x = lp.clone().requires_grad_()
    got = A.get_policy_loss(name)(x, old, adv, mask, clip_low=0.2, clip_high=0.28, rollout_is_weights=w)
    got.loss.backward()
    y = lp.clone().requires_grad_()
    valid = mask
    neg = y - old
    if name == "gspo":
        seq = torch.where(valid, neg, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        neg = y - y.detach() + seq.detach().unsqueeze(-1)
    r = torch.exp(torch.clamp(neg, -20, 20))
    pg1 = -adv * r
    if name == "reinforce":
        per = pg1
    else:
        clip1 = torch.maximum(pg1, -adv * torch.clamp(r, 0.8, 1.28))
        per = clip1 if name == "gspo" else torch.where(adv < 0, torch.minimum(clip1, -adv * 3.0), clip1)
    want = torch.where(valid, per * w, 0.0).sum() / valid.sum()
    want.backward()
    torch.testing.assert_close(got.loss, want)
    torch.testing.assert_close(x.grad, y.grad)


def test_every_clip_branch_has_the_gradient_its_formula_says():
    """Hand-placed log-ratios on both sides of every bound, for both advantage signs."""
    lr = torch.tensor([[-0.9, -0.5, 0.0, 0.1, 0.5, 3.0]] * 2, dtype=torch.float64)
    adv = torch.tensor([[1.0] * 6, [-1.0] * 6], dtype=torch.float64)
    lp = torch.full_like(lr, -1.0)
    old = lp - lr
    mask = torch.ones_like(lr, dtype=torch.bool)
    # CISPO: the weight is clipped, never the gradient: d/dlogp = -clip(r) A / N
    _, g = _check("cispo", lp, old, adv, mask)
    r = lr.exp()
    torch.testing.assert_close(g, -(r.clamp(0.7, 1.28)) * adv / 12)
    # GMPO: a clipped token's gradient is 0 only against the advantage's direction
    _, g = _check("geo_mean", lp, old, adv, mask, "seq-mean-token-mean")
    pinned = ((adv > 0) & (lr > 0.2)) | ((adv < 0) & (lr < -0.3))
    assert (g[pinned] == 0).all() and (g[~pinned] != 0).all()
    # DPPO-TV: tokens whose probability moved past the bound in A's direction get no gradient
    _, g = _check("dppo_tv", lp, old, adv, mask)
    dp = lp.exp() - old.exp()
    masked = ((adv > 0) & (dp > 0.05)) | ((adv < 0) & (dp < -0.1))
    assert masked.any() and (~masked).any() and (g[masked] == 0).all() and (g[~masked] != 0).all()
    _check("dppo_kl", lp, old, adv, mask)


@st.composite
def padded_cases(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < draw(st.floats(0.0, 1.0))
    for b in range(B):  # some rows fully padded, some full
        kind = draw(st.sampled_from(["holes", "empty", "full"]))
        if kind != "holes":
            mask[b] = kind == "full"
    spread = draw(st.sampled_from([0.01, 1.0, 30.0]))  # 30: beyond the +-20 log-ratio clamp
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * (5 if spread < 30 else 40) - 1e-3
    old = (lp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.0, 1.0, 10.0]))
    return lp, old, adv, mask, draw(st.sampled_from(["token-mean", "token-sum", "seq-mean-token-mean"])), seed


@FAST
@given(padded_cases(), st.sampled_from(NEW_LOSSES))
def test_property_padding_holes_empty_rows_and_extreme_ratios(case, name):
    """Matches the reference; padding (whatever it holds) gets no gradient and changes nothing; empty rows give 0."""
    lp, old, adv, mask, mode, seed = case
    mode = "seq-mean-token-mean" if name == "geo_mean" else mode
    out, grad = _check(name, lp, old, adv, mask, mode, seed=seed, tol=1e-7)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    junk = lambda x: torch.where(mask, x, torch.full_like(x, -7.0))  # noqa: E731
    again, grad2 = _run(name, junk(lp), junk(old), junk(adv), mask, mode, seed=seed)
    torch.testing.assert_close(again.loss, out.loss)
    torch.testing.assert_close(grad2, grad)
    if not mask.any():
        assert float(out.loss.detach()) == 0.0


def test_token_sum_adds_up_over_micro_batches_and_ranks():
    lp, old, adv, mask = _case(6, 5, seed=4)
    full = O.agg_loss(lp, mask, "token-sum")
    torch.testing.assert_close(full, torch.where(mask, lp, 0.0).sum())
    torch.testing.assert_close(O.agg_loss_ref(lp, mask, "token-sum"), full)
    halves = [O.agg_loss(lp[s], mask[s], O.Aggregation(mode="token-sum", dp_size=2))
              for s in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(halves) / 2, full)  # DP averaging of rank losses gives the global sum
    x = lp.clone().requires_grad_()
    out = O.policy_loss(x, old, adv, mask, "vanilla", clip_low=0.2, clip_high=0.28, agg="token-sum")
    ref = O.policy_loss_ref(lp, old, adv, mask, "vanilla", 0.2, 0.28, 3.0, "token-sum")
    torch.testing.assert_close(out.loss, ref.loss)


# ---------------------------------------------------------------------------------------------- estimators

def _ref_scores(r, m):
    return [sum(float(r[b, t]) for t in range(r.shape[1]) if m[b, t]) for b in range(r.shape[0])]


def ref_estimator(name, r, m, index, norm_by_std=True, eps=1e-6):
    s = _ref_scores(r, m)
    groups = {}
    for b, g in enumerate(index):
        groups.setdefault(g, []).append(b)
    out = [0.0] * len(s)
    if name == "gpg":
        flat = sum(len(rows) for rows in groups.values() if len({s[b] for b in rows}) == 1)
        alpha = len(s) / (len(s) - flat) if len(s) > flat else 1.0
    for rows in groups.values():
        vals = [s[b] for b in rows]
        if name == "opo":
            lens = [int(m[b].sum()) for b in rows]
            base = sum(L * v for L, v in zip(lens, vals)) / sum(lens) if sum(lens) else 0.0
            for b in rows:
                out[b] = s[b] - base
        elif name == "gpg":
            mean = sum(vals) / len(vals)
            for b in rows:
                out[b] = alpha * (s[b] - mean)
        elif len(rows) >= 2:  # grpo_passk
            best = max(vals)
            first = rows[vals.index(best)]
            second = sorted(vals, reverse=True)[1]
            gap = best - second
            if norm_by_std:
                mean = sum(vals) / len(vals)
                gap /= math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) + eps
            out[first] = gap
    return torch.tensor(out, dtype=torch.float64).unsqueeze(-1) * m


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_estimators_match_float64_reference(name, norm_by_std):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(9, 6, generator=g, dtype=torch.float64)
    m = torch.rand(9, 6, generator=g) > 0.3
    m[4] = False
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d"], dtype=object)
    r[6:, :] = 0.0
    r[6:, 0] = 1.0  # group d: all scores equal where their first token is valid
    m[6:, 0] = True
    got = A.get_advantage(name)(r, m, index=index, norm_by_std=norm_by_std)
    torch.testing.assert_close(got.advantages, ref_estimator(name, r, m, list(index), norm_by_std))
    assert (got.advantages[~m] == 0).all()


def test_passk_ties_give_zero_and_the_first_best_wins():
    r = torch.tensor([[1.0], [3.0], [3.0], [2.0], [5.0], [1.0]], dtype=torch.float64)
    m = torch.ones_like(r, dtype=torch.bool)
    adv = A.get_advantage("grpo_passk")(r, m, index=torch.tensor([0, 0, 0, 1, 1, 1]), norm_by_std=False)
    assert adv.advantages[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]


@FAST
@given(st.integers(1, 10), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from(["opo", "gpg", "grpo_passk"]),
       st.booleans())
def test_property_single_response_groups_and_padding(B, T, seed, name, norm_by_std):
    """Singletons get 0 (never NaN); masked tokens 0; always the reference."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) > 0.4
    index = torch.randint(0, max(1, B // 2), (B,), generator=g)
    index[0] = 10_000  # a singleton group
    got = A.get_advantage(name)(r, m, index=index, norm_by_std=norm_by_std).advantages
    assert torch.isfinite(got).all() and (got[~m] == 0).all() and (got[0] == 0).all()
    torch.testing.assert_close(got, ref_estimator(name, r, m, index.tolist(), norm_by_std))


# ---------------------------------------------------------------------------------------------- config

def test_params_are_typed_and_validated_with_the_key_named():
    cfg = load_config(PPOConfig, None, ["actor.policy_loss=sapo", "actor.policy_loss_params.tau_pos=2"])
    assert cfg.actor.loss_params() == P.SAPOParams(tau_pos=2.0)
    cfg = load_config(PPOConfig, None, ["actor.policy_loss=cispo", "actor.clip_ratio_low=10"])  # upstream's example
    assert cfg.actor.loss_params() is None and cfg.actor.clip_ratio_low == 10.0
    bad = {("actor.policy_loss=sapo", "actor.policy_loss_params.tau_poss=5"):
           r"unknown config key 'actor.policy_loss_params.tau_poss'.*did you mean 'tau_pos'",
           ("actor.policy_loss=cispo", "actor.policy_loss_params.clip_high=5"):
           r"takes no parameters \(got clip_high\); its clip bounds are actor.clip_ratio_low",
           ("actor.clip_ratio_low=10",): r"clip_ratio_low.*must be in \[0, 1\) for policy loss 'vanilla'",
           ("actor.policy_loss=dro",): r"'dro' needs actor.policy_loss_params.beta",
           ("actor.policy_loss_params.tau_pos=2",): r"policy loss 'vanilla' takes no parameters \(got tau_pos\)",
           ("actor.policy_loss=sapo", "actor.policy_loss_params.tau_neg=-1"): r"tau_neg must be a finite number > 0",
           ("actor.policy_loss=cispoo",): r"actor.policy_loss: unknown policy loss 'cispoo' \(did you mean 'cispo'",
           ("algorithm.adv_estimator=opoo",): r"unknown advantage estimator 'opoo'.*grpo_passk, opo",
           ("algorithm.rollout_correction.bypass=true", "algorithm.rollout_correction.is_level=token"):
           r"bypass makes the rollout log-probs the old ones"}
    for overrides, msg in bad.items():
        with pytest.raises(VerlConfigError, match=msg):
            load_config(PPOConfig, None, list(overrides))


def test_rollout_rejection_turns_off_the_on_policy_shortcut_and_is_weights_keep_it():
    """IS weights come from the on-policy update's own forward; rejection changes the loss's token counts before
    the update runs, so it needs the old-log-prob pass."""
    assert load_config(PPOConfig, None, []).on_policy
    assert load_config(PPOConfig, None, ["algorithm.rollout_correction.is_level=token"]).on_policy
    assert load_config(PPOConfig, None, ["algorithm.rollout_correction.is_level=sequence"]).on_policy
    assert not load_config(PPOConfig, None, ["algorithm.rollout_correction.rejection_level=token"]).on_policy
    assert load_config(PPOConfig, None, ["algorithm.rollout_correction.bypass=true"]).on_policy


# ---------------------------------------------------------------------------------------------- rollout correction

def _rc_case():
    # log(pi_old) - log(mu) per token: row 0 mild, row 1 one large token, row 2 fully padded
    d = torch.tensor([[0.1, -0.2, 0.0, 0.0], [0.0, 1.5, -0.1, 0.0], [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    mu = torch.full_like(d, -1.0)
    return mu + d, mu, mask


def test_truncated_is_weights_by_hand():
    old, mu, mask = _rc_case()
    e = math.exp
    want_tok = [[e(0.1), e(-0.2), 1.0, 1.0], [1.0, 2.0, e(-0.1), 1.0], [1.0] * 4]
    torch.testing.assert_close(is_weights(old, mu, mask, "token", 2.0), torch.tensor(want_tok, dtype=torch.float64))
    s0, s1 = e(0.1 - 0.2), min(e(1.5 - 0.1), 2.0)
    want_seq = [[s0, s0, s0, 1.0], [s1] * 4, [1.0] * 4]
    torch.testing.assert_close(is_weights(old, mu, mask, "sequence", 2.0), torch.tensor(want_seq, dtype=torch.float64))


def test_rejection_levels_by_hand():
    old, mu, mask = _rc_case()
    valid = mask.bool()
    tok = rejection_keep(old, mu, mask, "token", 0.85, 2.0)
    assert tok.tolist() == [[True, False, True, False], [True, False, True, True], [False] * 4]  # e^-0.2, e^1.5 out
    seq = rejection_keep(old, mu, mask, "sequence", 0.5, 2.0)  # row 1 product e^1.4 > 2: whole row out
    assert seq.tolist() == [[True, True, True, False], [False] * 4, [False] * 4]
    geo = rejection_keep(old, mu, mask, "geometric", 0.5, 1.5)  # row 1 mean log 0.35 -> 1.42 <= 1.5
    assert (geo == valid).all()
    geo = rejection_keep(old, mu, mask, "geometric", 0.5, 1.4)
    assert geo.tolist()[1] == [False] * 4


def test_rollout_correction_metrics_by_hand():
    old, mu, mask = _rc_case()
    cfg = RolloutCorrectionConfig(is_level="token", is_cap=2.0, rejection_level="token", rejection_lower=0.85)
    corr = rollout_correction(old, mu, mask, cfg)
    w = [math.exp(0.1), math.exp(-0.2), 1.0, 1.0, 2.0, math.exp(-0.1), 1.0]
    m = corr.metrics
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/is_weight_min"] == pytest.approx(w[1])
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(sum(w) / 7)
    assert m["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 7)
    assert m["rollout_corr/rejected_frac"] == pytest.approx(2 / 7)  # e^-0.2 < 0.85 and e^1.5 > 2
    assert m["rollout_corr/rejected_seq_frac"] == pytest.approx(1.0)  # the padded row is not a sequence


def test_identical_log_probs_make_the_correction_a_no_op():
    old, _, mask = _rc_case()
    for level in ("token", "sequence"):
        for rej in ("token", "sequence", "geometric"):
            cfg = RolloutCorrectionConfig(is_level=level, rejection_level=rej)
            corr = rollout_correction(old, old.clone(), mask, cfg)
            assert (corr.weights == 1).all() and (corr.keep == mask.bool()).all()
            assert corr.metrics["rollout_corr/rejected_frac"] == 0 and corr.metrics["rollout_corr/is_weight_max"] == 1


# ---------------------------------------------------------------------------------------------- trainer wiring

def _steps(out_dir):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


QUIET = ["trainer.total_steps=1", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
         "warmup.steps=0"]


@needs_ext
@pytest.mark.parametrize("overrides", [
    ["actor.policy_loss=cispo", "actor.clip_ratio_high=4.0", "algorithm.adv_estimator=opo",
     "actor.clip_ratio_low=10"],
    ["actor.policy_loss=sapo", "algorithm.adv_estimator=grpo_passk", "actor.loss_agg_mode=seq-mean-token-mean"],
    ["actor.policy_loss=gpg", "algorithm.adv_estimator=gpg", "actor.loss_agg_mode=token-sum"],
    ["actor.policy_loss=dppo_tv", "actor.ppo_epochs=2"],
    ["actor.policy_loss=dppo_kl", "actor.clip_ratio_high=0.1"],
    ["actor.policy_loss=clip_cov", "actor.policy_loss_params.clip_cov_ratio=0.1"],
    ["actor.policy_loss=kl_cov", "actor.loss_agg_mode=token-sum"],
    ["actor.policy_loss=geo_mean"],
    ["actor.policy_loss=dro", "actor.policy_loss_params.beta=0.1", "actor.use_kl_loss=true"],
], ids=lambda o: "+".join(x.split("=")[1] for x in o[:2]))
def test_trainer_runs_each_new_algorithm_by_config(tmp_path, tiny_args, overrides):
    from verl.trainer.main_ppo import main
    assert main(tiny_args(*overrides, *QUIET)) == 0
    (step,) = _steps(tmp_path / "run")
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/grad_norm"])


@needs_ext
def test_train_decoder_makes_rollout_correction_a_no_op(tmp_path, tiny_args):
    """torch engine + rollout.decoder=train: rollout and training log-probs agree bit for bit, so the weights are
    all 1, nothing is rejected, and the update is the uncorrected one."""
    from verl.trainer.main_ppo import main
    base = ["rollout.decoder=train", "actor.mini_batch_size=2", *QUIET]
    main(tiny_args(*base, "algorithm.rollout_correction.is_level=sequence",
                   "algorithm.rollout_correction.rejection_level=token",
                   "algorithm.rollout_correction.rejection_lower=0.999",
                   "algorithm.rollout_correction.rejection_upper=1.001", out="corr"))
    main(tiny_args(*base, out="plain"))
    (corr,), (plain,) = _steps(tmp_path / "corr"), _steps(tmp_path / "plain")
    assert corr["rollout/mismatch_max"] == 0.0
    assert corr["rollout_corr/is_weight_min"] == corr["rollout_corr/is_weight_max"] == 1.0
    assert corr["rollout_corr/rejected_frac"] == 0.0 and corr["rollout_corr/rejected_seq_frac"] == 0.0
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert corr[k] == plain[k], k


@needs_ext
def test_bypass_uses_rollout_log_probs_as_old(tmp_path, tiny_args):
    from verl.trainer.main_ppo import main
    main(tiny_args("algorithm.rollout_correction.bypass=true", "actor.ppo_epochs=2", *QUIET))
    (step,) = _steps(tmp_path / "run")
    assert math.isfinite(step["actor/pg_loss"]) and "rollout/mismatch_max" not in step


def test_bad_inputs_name_the_argument():
    lp, old, adv, mask = _case(3, 4, seed=0)
    for name in NEW_LOSSES:
        extra = _extra(name)
        fn = A.get_policy_loss(name)
        with pytest.raises(ValueError, match=f"{name}: `advantages` must have the shape"):
            fn(lp, old, adv[:, :2], mask, **extra)
        with pytest.raises(TypeError, match=f"{name}: `logprob` must be a floating-point tensor"):
            fn(lp.long(), old, adv, mask, **extra)
        with pytest.raises(ValueError, match="`rollout_is_weights` must have the shape"):
            fn(lp, old, adv, mask, rollout_is_weights=adv[:1], **extra)
    for name in ("opo", "gpg", "grpo_passk"):
        with pytest.raises(ValueError, match=f"{name}: `mask` must have the shape of `token_level_rewards`"):
            A.get_advantage(name)(adv, mask[:, :2], index=torch.arange(3))
        with pytest.raises(VerlConfigError, match=f"'{name}' needs `index`"):
            A.get_advantage(name)(adv, mask)
    with pytest.raises(ValueError, match="`rollout_log_probs` must have the shape"):
        rollout_correction(old, old[:, :2], mask, RolloutCorrectionConfig(is_level="token"))
