"""Advantage estimators, selected by name: `get_advantage("grpo")(token_level_rewards, response_mask, index=uid)`.

Every estimator has one calling convention (so the trainer needs no per-algorithm branches):

    fn(token_level_rewards [B, T], response_mask [B, T], *, values=None [B, T], index=None [B],
       baseline=None [B], gamma=1.0, lam=1.0, eps=1e-6, norm_by_std=True, check_finite=True)
       -> AdvantageResult(advantages [B, T], returns [B, T], num_nonfinite int64 0-d)

Arguments an estimator does not use are ignored; a missing one it needs raises VerlConfigError. `index` is the
prompt id of each sequence (int tensor, or numpy array / list of ints or strings such as uids). Outcome
estimators score a sequence by the sum of its valid token rewards. NaN/inf inputs raise unless check_finite=False.
Add one with:

    @register_advantage("my_estimator")
    def my_estimator(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0,
                     lam=1.0, eps=1e-6, norm_by_std=True, check_finite=True): ...
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from verl.registry import Registry
from verl.errors import VerlConfigError
from verl.ops.checks import check_bt, valid_mask
from verl.ops.rl import (AdvantageResult, _raise_if_nonfinite, as_group_index, compute_gae, outcome_advantage,
                         reinforce_plus_plus)

__all__ = ["ADVANTAGES", "AdvantageInfo", "advantage_info", "register_advantage", "get_advantage"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageInfo:
    """What an estimator needs from the rest of the algorithm: the PPO flow reads this, so registering an
    estimator never edits the flow."""

    needs_critic: bool = False
    """Reads `values` (a critic's value estimates) and returns `returns` the critic trains on."""
    needs_baseline: bool = False
    """Reads `baseline` [B]: the reward of each prompt's greedy response (ReMax)."""
    needs_group: bool = False
    """Compares the responses of one prompt (`index`): needs rollout.n >= 2."""
    upstream: str = ""
    """How it deliberately differs from upstream verl's estimator of the same name, and why ('' when it does not;
    `verl algos` and docs/from_verl.md list these)."""


ADVANTAGES: Registry = Registry("advantage estimator", required=(
    "token_level_rewards", "response_mask", "values", "index", "baseline", "gamma", "lam", "eps", "norm_by_std",
    "check_finite"), meta_type=AdvantageInfo)


def register_advantage(name: str, *aliases: str, needs_critic: bool = False, needs_baseline: bool = False,
                       needs_group: bool = False, upstream: str = ""):
    """Decorator registering an advantage estimator under `name` (and aliases), with what it needs (and how it
    differs from upstream verl's, if it does)."""
    return ADVANTAGES.register(name, *aliases, needs_critic=needs_critic, needs_baseline=needs_baseline,
                               needs_group=needs_group, upstream=upstream)


def get_advantage(name: str):
    """The estimator registered as `name`; unknown names list the known ones."""
    return ADVANTAGES.get(name)


def advantage_info(name: str) -> AdvantageInfo:
    """What estimator `name` needs (critic, greedy baseline, groups)."""
    return ADVANTAGES.meta(name)


def _need(value, what: str, estimator: str):
    if value is None:
        raise VerlConfigError(f"advantage estimator {estimator!r} needs `{what}`")
    return value


@register_advantage("gae", needs_critic=True)
def gae(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, values=None, index=None, baseline=None,
        gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6, norm_by_std: bool = True,
        check_finite: bool = True) -> AdvantageResult:
    """PPO's GAE with a critic (`values` [B, T] required); advantages whitened over the mask, returns raw."""
    return compute_gae(token_level_rewards, _need(values, "values", "gae"), response_mask, gamma, lam,
                       check_finite=check_finite)


def _outcome(estimator: str, norm_by_std: bool, token_level_rewards, response_mask, index, baseline, eps,
             check_finite, name: str) -> AdvantageResult:
    if estimator == "remax":
        _need(baseline, "baseline", name)
        index = torch.arange(token_level_rewards.shape[0], device=token_level_rewards.device)
    return outcome_advantage(token_level_rewards, response_mask, _need(index, "index", name), estimator, eps=eps,
                             norm_by_std=norm_by_std, baseline=baseline, check_finite=check_finite)


@register_advantage("grpo", needs_group=True)
def grpo(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
         eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """GRPO: (score - group mean) / (group std + eps); norm_by_std=False is Dr.GRPO. Needs `index` [B]."""
    return _outcome("grpo", norm_by_std, token_level_rewards, response_mask, index, None, eps, check_finite, "grpo")


@register_advantage("dr_grpo", needs_group=True)
def dr_grpo(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
            eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """Dr.GRPO: score - group mean (never divided by the std, whatever norm_by_std says). Needs `index` [B]."""
    return _outcome("grpo", False, token_level_rewards, response_mask, index, None, eps, check_finite, "dr_grpo")


@register_advantage("rloo", needs_group=True)
def rloo(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
         eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """RLOO: score - mean score of the group's other samples. Needs `index` [B]."""
    return _outcome("rloo", True, token_level_rewards, response_mask, index, None, eps, check_finite, "rloo")


@register_advantage("remax", needs_baseline=True)
def remax(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
          eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """ReMax: score - `baseline` [B] (the reward of the prompt's greedy response)."""
    return _outcome("remax", True, token_level_rewards, response_mask, None, baseline, eps, check_finite, "remax")


@register_advantage("reinforce_plus_plus", "reinforce++")
def reinforce_pp(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
                 eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """REINFORCE++: discounted token returns (gamma), whitened over the batch's valid tokens."""
    return reinforce_plus_plus(token_level_rewards, response_mask, gamma, check_finite=check_finite)


@register_advantage("reinforce_plus_plus_baseline", "reinforce++-baseline", needs_group=True)
def reinforce_pp_baseline(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0,
                          lam=1.0, eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """REINFORCE++-baseline: score - group mean, whitened over the batch's valid tokens. Needs `index` [B]."""
    return _outcome("reinforce_plus_plus_baseline", True, token_level_rewards, response_mask, index, None, eps,
                    check_finite, "reinforce_plus_plus_baseline")


# ---------------------------------------------------------------------------------------------- OPO, GPG, pass@k
#
# Plain PyTorch: each is a per-group reduction over B scores (index_add / scatter_reduce), far below a kernel's
# launch cost at any batch size; shared with the fused outcome estimators: scores = sum of the valid token rewards.

def _group_scores(token_level_rewards, response_mask, index, check_finite, name):
    """(scores [B] float64, group id [B] dense, group sizes [G], valid [B, T]) of an outcome estimator."""
    check_bt(token_level_rewards, response_mask, name, "token_level_rewards")
    r = token_level_rewards.detach()
    valid = valid_mask(response_mask)
    bad = (~torch.isfinite(r) & valid).sum()
    if check_finite:
        _raise_if_nonfinite(bad, f"token_level_rewards ({name})")
    scores = torch.where(valid, r.double(), 0.0).sum(-1)
    idx = as_group_index(_need(index, "index", name), r.shape[0], r.device)
    gid = torch.unique(idx, return_inverse=True)[1]
    size = torch.zeros(int(gid.max()) + 1, dtype=torch.float64, device=r.device).index_add_(
        0, gid, torch.ones_like(scores))
    return scores, gid, size, valid, bad


def _per_group(values, gid, size, reduce: str):
    out = torch.zeros_like(size)
    if reduce == "sum":
        return out.index_add_(0, gid, values)
    return out.scatter_reduce_(0, gid, values, reduce, include_self=False)


def _broadcast(seq_adv, token_level_rewards, valid, bad) -> AdvantageResult:
    adv = torch.where(valid, seq_adv.unsqueeze(-1), 0.0).to(token_level_rewards.dtype)
    return AdvantageResult(adv, adv, bad)


@register_advantage("opo", needs_group=True, upstream="a single-response group gets advantage 0 (its own score "
                    "is the formula's baseline); upstream special-cases it to baseline 0, i.e. A = s")
def opo(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
        eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """OPO (arXiv:2505.23585): score - the group's length-weighted mean score sum_j |o_j| s_j / sum_j |o_j| (the
    optimal baseline under on-policy sampling), |o| = valid tokens. Needs `index` [B]. A single-response group
    gets 0 (the formula's own baseline is its score; upstream verl special-cases it to baseline 0, i.e. A = s)."""
    s, gid, size, valid, bad = _group_scores(token_level_rewards, response_mask, index, check_finite, "opo")
    length = valid.sum(-1).double()
    total_len = _per_group(length, gid, size, "sum")
    weighted = _per_group(length * s, gid, size, "sum")
    base = torch.where(total_len > 0, weighted / total_len.clamp(min=1), 0.0)
    return _broadcast(s - base[gid], token_level_rewards, valid, bad)


@register_advantage("gpg", needs_group=True, upstream="alpha = B / (B - M), M the responses in groups whose "
                    "scores are all equal, as the paper defines it; upstream takes B / (responses with a non-zero "
                    "score) and gives a single-response group mean 0")
def gpg(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
        eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """GPG (arXiv:2504.02546): alpha * (score - group mean) / F_norm with F_norm = 1 and alpha = B / (B - M), M the
    responses in groups whose scores are all equal (they carry no signal, so alpha rescales the batch-mean
    gradient to the valid responses; that includes single-response groups, which get 0). Upstream verl instead
    takes alpha = B / #(nonzero scores) and gives a single-response group mean 0 (A = alpha * s); we follow the
    paper. Needs `index` [B]; `norm_by_std` is ignored (GPG does not divide by the std)."""
    s, gid, size, valid, bad = _group_scores(token_level_rewards, response_mask, index, check_finite, "gpg")
    mean = _per_group(s, gid, size, "sum") / size
    flat = _per_group(s, gid, size, "amax") == _per_group(s, gid, size, "amin")
    n_invalid = float(size[flat].sum())
    B = s.shape[0]
    alpha = B / (B - n_invalid) if B > n_invalid else 1.0
    return _broadcast(alpha * (s - mean[gid]), token_level_rewards, valid, bad)


@register_advantage("grpo_passk", needs_group=True, upstream="a single-response group gets 0 (upstream "
                    "raises on it)")
def grpo_passk(token_level_rewards, response_mask, *, values=None, index=None, baseline=None, gamma=1.0, lam=1.0,
               eps=1e-6, norm_by_std=True, check_finite=True) -> AdvantageResult:
    """GRPO for pass@k (arXiv:2503.19595): only each group's best response gets an advantage, r_max - r_second
    (the second-largest score, counting ties, so a tied best gets 0), divided by (group unbiased std + eps) when
    norm_by_std. Ties for the best go to the lowest batch index. Needs `index` [B]; a single-response group gets
    0 (upstream verl raises on it)."""
    s, gid, size, valid, bad = _group_scores(token_level_rewards, response_mask, index, check_finite, "grpo_passk")
    B = s.shape[0]
    rows = torch.arange(B, device=s.device)
    best = _per_group(s, gid, size, "amax")
    first = _per_group(torch.where(s == best[gid], rows, B).double(), gid, size, "amin").long()
    is_first = rows == first[gid]
    second = _per_group(torch.where(is_first, float("-inf"), s), gid, size, "amax")
    gap = torch.where(size >= 2, best - second, 0.0)
    if norm_by_std:
        mean = _per_group(s, gid, size, "sum") / size
        var = _per_group((s - mean[gid]) ** 2, gid, size, "sum") / (size - 1).clamp(min=1)
        gap = gap / (var.sqrt() + eps)
    return _broadcast(torch.where(is_first, gap[gid], 0.0), token_level_rewards, valid, bad)
