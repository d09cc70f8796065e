"""Every registered algorithm against a float64 transcription of its published formula (tests/algos/formulas.py,
each function citing its paper and upstream verl's code), through the public API (verl.algos), with the same
hyperparameters, on random inputs with padding (right-padded rows, a fully padded row, a one-token row, garbage
values under the padding) and edge cases (log-ratios past the +-20 clamp, zero advantages, tied scores, groups
of one). Values, gradients and the statistics the implementation claims to share with upstream.

Where we deliberately differ from upstream verl, the oracle's docstring says how and the test asserts our side.
`test_every_registered_algorithm_has_a_formula_test` fails when an algorithm is registered without one.
tests/algos/test_formulas_trainer.py runs the same oracles through one trainer micro-step each."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import verl.algos as A
from verl.algos.rollout_correction import is_weights, rejection_keep, rollout_correction
from verl.config.ppo import RolloutCorrectionConfig

from tests.algos import formulas as F

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
LOW, HIGH, C = 0.2, 0.28, 3.0  # the actor's clip_ratio_low / high / clip_ratio_c where a loss sets none below

# name -> (its hyperparameters, oracle(lp, old, adv, mask, hp) -> (per-token loss, stats), stats to compare).
# A loss's clip bounds go both to the call's clip_low / clip_high / clip_c (the actor's clip_ratio_*) and to its
# params dataclass where it declares such fields, with the same values: the test holds whichever it reads.
POLICY_LOSSES = {
    "vanilla": (dict(clip_low=LOW, clip_high=HIGH, clip_c=C),
                lambda lp, o, a, m, h: F.ppo(lp, o, a, m, h["clip_low"], h["clip_high"], h["clip_c"]),
                ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")),
    "gspo": (dict(clip_low=LOW, clip_high=HIGH),
             lambda lp, o, a, m, h: F.gspo(lp, o, a, m, h["clip_low"], h["clip_high"]), ("pg_clipfrac", "ppo_kl")),
    "reinforce": ({}, lambda lp, o, a, m, h: F.reinforce(lp, o, a, m), ()),
    "cispo": (dict(clip_low=0.3, clip_high=0.25),
              lambda lp, o, a, m, h: F.cispo(lp, o, a, m, h["clip_low"], h["clip_high"]), ()),
    "sapo": (dict(tau_pos=1.0, tau_neg=1.05), lambda lp, o, a, m, h: F.sapo(lp, o, a, m, h["tau_pos"], h["tau_neg"]),
             ()),
    "gpg": ({}, lambda lp, o, a, m, h: F.gpg_loss(lp, o, a, m), ()),
    "dppo_tv": (dict(clip_low=0.1, clip_high=0.05, clip_c=2.0, threshold_low=0.1, threshold_high=0.05, is_cap=2.0),
                lambda lp, o, a, m, h: F.dppo(lp, o, a, m, "tv", h["threshold_low"], h["threshold_high"], h["is_cap"]),
                ("pg_clipfrac", "pg_clipfrac_lower")),
    "dppo_kl": (dict(clip_low=0.02, clip_high=0.05, clip_c=2.0, threshold_low=0.02, threshold_high=0.05, is_cap=2.0),
                lambda lp, o, a, m, h: F.dppo(lp, o, a, m, "kl", h["threshold_low"], h["threshold_high"], h["is_cap"]),
                ("pg_clipfrac", "pg_clipfrac_lower")),
    # clip_cov_ratio 1.0: every candidate token is cut, so the random draw does not matter (see F.clip_cov)
    "clip_cov": (dict(clip_low=LOW, clip_high=HIGH, clip_cov_ratio=1.0, cov_lb=0.0, cov_ub=5.0),
                 lambda lp, o, a, m, h: F.clip_cov(lp, o, a, m, h["clip_low"], h["clip_high"], h["clip_cov_ratio"],
                                                   h["cov_lb"], h["cov_ub"]), ("pg_clipfrac",)),
    "kl_cov": (dict(kl_cov_ratio=0.3, ppo_kl_coef=0.7),
               lambda lp, o, a, m, h: F.kl_cov(lp, o, a, m, h["kl_cov_ratio"], h["ppo_kl_coef"]), ("ppo_kl",)),
    "geo_mean": (dict(clip_low=0.3, clip_high=0.2), None, ("pg_clipfrac", "pg_clipfrac_lower")),
    "dro": (dict(beta=0.3), lambda lp, o, a, m, h: F.dro(lp, o, a, m, h["beta"]), ()),
}
ALIASES = {"ppo": "vanilla", "gmpo": "geo_mean"}


def hyper(name: str) -> dict:
    return POLICY_LOSSES[ALIASES.get(name, name)][0]


def params_fields(name: str) -> dict:
    """The hyperparameters that `name`'s params dataclass declares (policy_loss_params.*)."""
    cls = A.policy_loss_info(name).params
    if cls is None:
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in hyper(name).items() if k in names}


def call_kwargs(name: str) -> dict:
    """clip_low / clip_high / clip_c (the actor's clip_ratio_*) and params, as the actor passes them."""
    h, fields = hyper(name), params_fields(name)
    kw = dict(clip_low=h.get("clip_low", LOW), clip_high=h.get("clip_high", HIGH), clip_c=h.get("clip_c", C))
    cls = A.policy_loss_info(name).params
    if cls is not None:
        kw["params"] = cls(**fields)
    return kw


def case(seed: int, B: int = 6, T: int = 7, spread: float = 0.35, extreme: bool = False):
    """(log-probs requiring grad, old log-probs, advantages, mask) in float64. Row 0 is fully padded, row 1 has one
    token, the rest are right-padded at random lengths; padding holds finite garbage."""
    g = torch.Generator().manual_seed(seed)
    lengths = [0, 1] + torch.randint(2, T + 1, (B - 2,), generator=g).tolist()
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5 - 0.05
    old = lp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    if extreme:  # log-ratios past the +-20 clamp in both directions
        old[2, 0], old[3, 1] = lp[2, 0] - 25.0, lp[3, 1] + 24.0
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[4, :2] = 0.0  # zero advantages: no update, and sgn(A) = 0 for GMPO
    lp = torch.where(mask.bool(), lp, -50.0)
    old = torch.where(mask.bool(), old, 30.0)
    return lp.requires_grad_(), old, adv, mask


def ours(name, lp, old, adv, mask, mode="token-mean", w=None):
    return A.get_policy_loss(name)(lp, old, adv, mask, agg=mode, rollout_is_weights=w, **call_kwargs(name))


def oracle(name, lp, old, adv, mask, mode="token-mean", w=None):
    """(loss, stats) of the transcription, aggregated as `mode` says (GMPO: its own sequence mean)."""
    name = ALIASES.get(name, name)
    h = hyper(name)
    if name == "geo_mean":
        seq, stats = F.gmpo(lp, old, adv, mask, h["clip_low"], h["clip_high"])
        rows = mask.bool().any(-1)
        if w is not None:  # IS weights enter as their per-sequence geometric mean, as upstream
            n = mask.sum(-1).clamp(min=1)
            seq = seq * torch.exp(F.where(mask, torch.log(w)).sum(-1) / n)
        return seq[rows].mean(), stats
    per, stats = POLICY_LOSSES[name][1](lp, old, adv, mask, h)
    if w is not None:
        per = per * w
    # a loss that always aggregates one way (sapo: per sequence, as upstream) declares it at registration
    return F.aggregate(per, mask, A.policy_loss_info(name).agg or mode), stats


def _compare(name, lp, old, adv, mask, mode="token-mean", w=None):
    got = ours(name, lp, old, adv, mask, mode, w)
    g_ours = torch.autograd.grad(got.loss, lp)[0]
    want, stats = oracle(name, lp, old, adv, mask, mode, w)
    g_want = torch.autograd.grad(want, lp)[0]
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12, msg=f"{name} {mode}: loss")
    valid = mask.bool()
    torch.testing.assert_close(g_ours[valid], g_want[valid], rtol=1e-9, atol=1e-12, msg=f"{name} {mode}: gradient")
    assert (g_ours[~valid] == 0).all(), f"{name}: padding got a gradient"
    for k in POLICY_LOSSES[ALIASES.get(name, name)][2]:
        assert float(getattr(got, k)) == pytest.approx(float(stats[k]), abs=1e-6), f"{name}: {k}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_equals_its_formula(name, mode):
    for seed in range(3):
        _compare(name, *case(seed), mode=mode)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_at_extreme_ratios_and_with_rollout_weights(name):
    lp, old, adv, mask = case(7, extreme=True)
    if name in ("clip_cov", "kl_cov"):  # their covariance selection is not defined by a +-25 log-ratio outlier
        lp, old, adv, mask = case(7)
    _compare(name, lp, old, adv, mask)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5 + 0.25
    _compare(name, lp, old, adv, mask, mode="seq-mean-token-mean", w=w)


def test_aliases_are_the_same_functions():
    for alias, name in ALIASES.items():
        assert A.get_policy_loss(alias) is A.get_policy_loss(name)


def test_reinforce_gradient_equals_upstream_reinforce_on_policy():
    """Upstream's REINFORCE loss is -A log pi; ours -A pi/pi_old (see F.reinforce): at pi = pi_old the gradients
    agree."""
    lp, _, adv, mask = case(2)
    got = ours("reinforce", lp, lp.detach(), adv, mask)
    g = torch.autograd.grad(got.loss, lp)[0]
    g_up = torch.autograd.grad(F.aggregate(-adv * lp, mask, "token-mean"), lp)[0]
    torch.testing.assert_close(g, g_up, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- advantages

def outcome_case(seed: int, B: int = 12, T: int = 6):
    """Token rewards with the score on each response's last valid token (as the trainer places them), groups of 4
    and one group of 1 at the end, tied scores in group 0, right padding, garbage under the padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[5] = 0  # an empty response
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    s = torch.randint(0, 4, (B,), generator=g).double() / 3
    s[:2] = 1.0  # a tie for group 0's best
    rewards = torch.full((B, T), 7.0, dtype=torch.float64)
    rewards[mask.bool()] = 0.0
    for b in range(B):
        if lengths[b]:
            rewards[b, lengths[b] - 1] = s[b]
    index = torch.tensor([0] * 4 + [1] * 4 + [2] * 3 + [3])
    return rewards, mask, index


ESTIMATORS = {
    "grpo": lambda r, m, i, v, b: F.grpo(r, m, i, 1e-6, True),
    "dr_grpo": lambda r, m, i, v, b: F.grpo(r, m, i, 1e-6, False),
    "rloo": lambda r, m, i, v, b: F.rloo(r, m, i),
    "opo": lambda r, m, i, v, b: F.opo(r, m, i),
    "gpg": lambda r, m, i, v, b: F.gpg_adv(r, m, i),
    "grpo_passk": lambda r, m, i, v, b: F.grpo_passk(r, m, i, 1e-6, True),
    "reinforce_plus_plus_baseline": lambda r, m, i, v, b: F.reinforce_pp_baseline(r, m, i),
    "remax": lambda r, m, i, v, b: F.remax(r, m, b),
    "reinforce_plus_plus": lambda r, m, i, v, b: F.reinforce_pp(r, m, 0.97)[0],
    "gae": lambda r, m, i, v, b: F.gae(r, v, m, 0.97, 0.9)[0],
}
EST_ALIASES = {"reinforce++": "reinforce_plus_plus", "reinforce++-baseline": "reinforce_plus_plus_baseline"}


def run_estimator(name, r, m, index, values, baseline):
    return A.get_advantage(name)(r.float(), m, values=values.float(), index=index, baseline=baseline.float(),
                                 gamma=0.97, lam=0.9, eps=1e-6, norm_by_std=True)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_advantage_estimator_equals_its_formula(name):
    for seed in range(3):
        r, m, index = outcome_case(seed)
        g = torch.Generator().manual_seed(seed + 100)
        values = torch.randn(r.shape, generator=g, dtype=torch.float64)
        if name in ("gae", "reinforce_plus_plus"):  # token-level rewards: every valid token carries one
            r = torch.where(m.bool(), torch.randn(r.shape, generator=g, dtype=torch.float64), 3.0)
            m = m.clone()
            m[6, 1] = 0.0  # a hole inside a response (a masked observation token): skipped, not a reset
        baseline = torch.rand(len(r), generator=g, dtype=torch.float64)
        got = run_estimator(name, r.float(), m, index, values, baseline)
        want = ESTIMATORS[name](r.float().double(), m, index, values.float().double(), baseline.float().double())
        torch.testing.assert_close(got.advantages.double(), want, rtol=1e-5, atol=1e-5, msg=name)
        if name == "gae":
            ret = F.gae(r.float().double(), values.float().double(), m, 0.97, 0.9)[1]
            torch.testing.assert_close(F.where(m, got.returns.double()), ret, rtol=1e-5, atol=1e-5)
        if name == "reinforce_plus_plus":
            ret = F.reinforce_pp(r.float().double(), m, 0.97)[1]
            torch.testing.assert_close(F.where(m, got.returns.double()), ret, rtol=1e-5, atol=1e-5)


def test_aliases_of_estimators():
    for alias, name in EST_ALIASES.items():
        assert A.get_advantage(alias) is A.get_advantage(name)


def test_groups_of_one_get_no_advantage():
    """Our deliberate difference from upstream for grpo, rloo, opo, reinforce++-baseline (upstream: A = s, or
    s / (1 + eps)) and grpo_passk (upstream raises): a response alone in its group gets 0."""
    r, m, index = outcome_case(0)
    for name in ("grpo", "dr_grpo", "rloo", "opo", "grpo_passk", "gpg"):
        adv = run_estimator(name, r, m, index, torch.zeros_like(r), torch.zeros(len(r), dtype=torch.float64))
        assert (adv.advantages[11] == 0).all(), name


def test_passk_tie_gives_the_first_best_zero():
    r, m, index = outcome_case(0)
    adv = run_estimator("grpo_passk", r, m, index, torch.zeros_like(r), torch.zeros(len(r), dtype=torch.float64))
    assert (adv.advantages[:4] == 0).all()  # rows 0 and 1 tie for the best: gap 0, the others get nothing


def test_remax_equals_upstream_reward_to_go_for_outcome_rewards():
    """Upstream ReMax is reward-to-go minus the baseline; with the reward on the last token (how the trainer
    places a score) that is the sequence reward on every token, as ours."""
    r, m, _ = outcome_case(1)
    b = torch.rand(len(r), dtype=torch.float64)
    togo = torch.flip(torch.cumsum(torch.flip(F.where(m, r), [-1]), -1), [-1])
    upstream = F.where(m, togo - b[:, None])
    got = A.get_advantage("remax")(r, m, baseline=b)
    torch.testing.assert_close(got.advantages, upstream, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- KL, value loss

KL_KINDS = ("kl", "abs", "mse", "low_var_kl", "k1+", "k3+")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "kl+": "k1+", "low_var_kl+": "k3+"}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind", KL_KINDS + tuple(KL_ALIASES))
def test_kl_penalty_equals_its_formula(kind, mode):
    lp, ref, _, mask = case(4, extreme=True)
    ref = ref.clone()
    ref[5, 0] = lp[5, 0].detach() + 40.0  # k3's exponent past its +-20 clamp, its value past +-10
    got_tok = A.get_kl(kind)(lp, ref)
    want_tok = F.kl(lp, ref, kind)
    valid = mask.bool()
    torch.testing.assert_close(got_tok[valid], want_tok[valid], rtol=1e-12, atol=1e-12)
    got = A.kl_loss(kind, lp, ref, mask, mode)
    want = F.aggregate(want_tok, mask, mode)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g1, g2 = torch.autograd.grad(got, lp)[0], torch.autograd.grad(want, lp)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_equals_its_formula(mode):
    g = torch.Generator().manual_seed(5)
    _, _, _, mask = case(5)
    v = torch.randn(mask.shape, generator=g, dtype=torch.float64).requires_grad_()
    old = v.detach() + 0.4 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ret = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    got = A.value_loss(v, old, ret, mask, 0.2, agg=mode)
    want, clipfrac = F.value_loss(v, old, ret, mask, 0.2, mode)
    torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got.loss, v)[0], torch.autograd.grad(want, v)[0])
    assert float(got.vf_clipfrac) == pytest.approx(float(clipfrac), abs=1e-6)
    critic, stats = A.critic_loss(v, mask, old, ret, cliprange=0.2, agg=A.Aggregation(mode=mode))
    torch.testing.assert_close(critic, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_modes_equal_their_formulas(mode):
    lp, _, _, mask = case(6)
    per = lp.detach() * 3.0
    torch.testing.assert_close(A.agg_loss(per, mask, mode), F.aggregate(per, mask, mode), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- rollout correction

def rc_case(seed: int):
    lp, old, _, mask = case(seed, spread=0.4)
    return old, lp.detach(), mask  # pi_old, mu (the rollout engine's), mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_equal_their_formula(level):
    for seed in range(3):
        old, mu, mask = rc_case(seed)
        got = is_weights(old, mu, mask, level, 1.7)
        want = F.is_weights(old, mu, mask, level, 1.7)
        valid = mask.bool()
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-12, atol=1e-12)
        assert (got[~valid] == 1).all()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_equals_its_formula(level):
    for seed in range(3):
        old, mu, mask = rc_case(seed)
        lo, hi = {"token": (0.7, 1.4), "sequence": (0.6, 1.5), "geometric": (0.85, 1.2)}[level]
        got = rejection_keep(old, mu, mask, level, lo, hi)
        want = F.rejection_keep(old, mu, mask, level, lo, hi)
        assert torch.equal(got, want), (level, seed)
        assert 0 < int(got.sum()) < int(mask.sum()), "the case should reject some tokens and keep others"


@pytest.mark.parametrize("name", ["vanilla", "cispo", "geo_mean"])
@pytest.mark.parametrize("is_level,rejection", [("token", "none"), ("sequence", "geometric"), ("none", "token")])
def test_corrected_loss_equals_the_formula(name, is_level, rejection):
    """The whole correction as the actor applies it: rejected tokens leave the loss mask (and the aggregation's
    counts), the truncated IS weights multiply the per-token loss."""
    lp, old, adv, mask = case(8)
    mu = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = RolloutCorrectionConfig(is_level=is_level, is_cap=1.6, rejection_level=rejection, rejection_lower=0.6,
                                  rejection_upper=1.5)
    corr = rollout_correction(old, mu, mask, cfg)
    got = ours(name, lp, old, adv, mask * corr.keep.double(), "token-mean", corr.weights)
    keep = F.rejection_keep(old, mu, mask, rejection, 0.6, 1.5) if rejection != "none" else mask.bool()
    w = F.is_weights(old, mu, mask, is_level, 1.6) if is_level != "none" else None
    want, _ = oracle(name, lp, old, adv, keep.double(), "token-mean", w)
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- completeness

def _builtin(registry) -> set[int]:
    return {id(registry.get(n)) for n in registry.names()
            if getattr(registry.get(n), "__module__", "").startswith("verl.")}


def test_every_registered_algorithm_has_a_formula_test():
    tested = {id(A.get_policy_loss(n)) for n in [*POLICY_LOSSES, *ALIASES]}
    assert _builtin(A.POLICY_LOSS_FNS) <= tested, "a registered policy loss has no formula test"
    tested = {id(A.get_advantage(n)) for n in [*ESTIMATORS, *EST_ALIASES]}
    assert _builtin(A.ADVANTAGES) <= tested, "a registered advantage estimator has no formula test"
    tested = {id(A.get_kl(n)) for n in [*KL_KINDS, *KL_ALIASES]}
    assert _builtin(A.KLS) <= tested, "a registered KL penalty has no formula test"
    assert set(A.AGG_MODES) == set(MODES)
    assert math.isfinite(LOW + HIGH + C)
