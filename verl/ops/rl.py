"""RL advantages: GAE and outcome (group) advantages.

Kernels: csrc/cpu/rl_advantage.cpp and csrc/cuda/rl_advantage.cu, driven by csrc/include/verl/rl_advantage.h
(schemas in csrc/ops.cpp). Per-token KL estimators and the fused losses live in verl/ops/losses.py.

Shapes: B sequences x T response tokens. `response_mask` [B, T] marks valid tokens (bool or any real dtype,
nonzero = valid). Outputs are 0 at masked positions.

- GAE skips masked positions: the recurrence carries the last valid next-value and the running advantage
  across them, so right-padding, left-padding or holes give identical results at the valid positions.
- Outcome estimators score each sequence by the sum of its valid token rewards and broadcast one advantage
  per sequence over its valid tokens. Groups come from `index` (prompt id per sequence: int tensor, or a numpy
  array / list of ints or strings). A group of size 1 gets advantage 0 under grpo, rloo and
  reinforce_plus_plus_baseline (no baseline exists without its own reward; never NaN).
- NaN/inf rewards (or values) at valid positions are counted (`num_nonfinite`); with `check_finite=True`
  (default) the wrappers raise `VerlRuntimeError` naming the count. That check reads one number back to the
  host, so inside `torch.compile(fullgraph=True)` pass `check_finite=False` and inspect `num_nonfinite`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from verl import _extension
from verl.errors import VerlRuntimeError
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_bt, check_floating, check_like, check_name, valid_mask
from verl.ops.masked import masked_sum_ref, masked_whiten

__all__ = ["AdvantageResult", "OUTCOME_ESTIMATORS", "compute_gae", "compute_gae_ref", "outcome_advantage",
           "outcome_advantage_ref", "reinforce_plus_plus", "as_group_index"]

OUTCOME_ESTIMATORS = ("grpo", "rloo", "remax", "reinforce_plus_plus_baseline")


class AdvantageResult(NamedTuple):
    """advantages, returns: [B, T] (0 where masked); num_nonfinite: int64 0-d count of NaN/inf inputs."""

    advantages: torch.Tensor
    returns: torch.Tensor
    num_nonfinite: torch.Tensor


def _nonfinite(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(x) & valid_mask(mask)).sum()


def _raise_if_nonfinite(num: torch.Tensor, what: str) -> None:
    n = int(num)
    if n:
        raise VerlRuntimeError(f"{n} NaN/inf value(s) in {what} at valid (mask != 0) positions; fix the reward "
                               f"function or critic, or pass check_finite=False and handle `num_nonfinite` yourself")


# ---------------------------------------------------------------------------------------------- GAE

_WHITEN_EPS = 1e-8  # masked_whiten's default


def check_gae(rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor, gamma: float,
              lam: float) -> None:
    """What the gae kernels check (csrc/include/verl/rl_advantage.h), run on both backends."""
    op = "gae"
    check_bt(rewards, mask, op, "rewards")
    if values is not None:
        check_like(rewards, values, op, "rewards", "values")
    check_arg(0.0 <= gamma <= 1.0, op, f"`gamma` must be in [0, 1], got {gamma}")
    check_arg(0.0 <= lam <= 1.0, op, f"`lam` must be in [0, 1], got {lam}")


def compute_gae_ref(rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor, gamma: float,
                    lam: float) -> AdvantageResult:
    """Per-timestep loop over T (vectorised over B): the way most RL frameworks write GAE. Not whitened."""
    check_gae(rewards, values, mask, gamma, lam)
    valid = valid_mask(mask)
    v = values if values is not None else torch.zeros_like(rewards)
    B, T = rewards.shape
    acc = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    next_v = torch.zeros(B, dtype=acc, device=rewards.device)
    run = torch.zeros(B, dtype=acc, device=rewards.device)
    adv = torch.zeros(B, T, dtype=acc, device=rewards.device)
    for t in range(T - 1, -1, -1):
        ok = valid[:, t]
        vt = v[:, t].to(acc)
        new = rewards[:, t].to(acc) + gamma * next_v - vt + gamma * lam * run
        run = torch.where(ok, new, run)
        next_v = torch.where(ok, vt, next_v)
        adv[:, t] = torch.where(ok, new, 0.0)
    ret = torch.where(valid, adv + v.to(acc), 0.0)
    bad = _nonfinite(rewards, mask) if values is None else (
        (~(torch.isfinite(rewards) & torch.isfinite(v)) & valid).sum())
    return AdvantageResult(adv.to(rewards.dtype), ret.to(rewards.dtype), bad)


def compute_gae(token_level_rewards: torch.Tensor, values: torch.Tensor | None, response_mask: torch.Tensor,
                gamma: float = 1.0, lam: float = 1.0, *, whiten: bool = True,
                check_finite: bool = True) -> AdvantageResult:
    """Generalised advantage estimation over the valid tokens.

    token_level_rewards, values, response_mask: [B, T]. values=None means a zero critic (then, with lam=1,
    advantages are the discounted returns). returns = raw advantages + values; `advantages` are whitened over
    the mask (masked_whiten: mean 0, unbiased variance 1) when `whiten`.
    """
    args = (token_level_rewards.detach(), None if values is None else values.detach(), response_mask)
    check_gae(*args, gamma, lam)
    fused = use_fused("gae", token_level_rewards)
    if fused:  # whitening statistics come out of the scan: one extra elementwise pass
        out = AdvantageResult(*torch.ops.verl.gae(*args, float(gamma), float(lam), _WHITEN_EPS if whiten else None))
    else:
        out = compute_gae_ref(*args, gamma, lam)
    if check_finite:
        _raise_if_nonfinite(out.num_nonfinite, "token_level_rewards or values (GAE)")
    if whiten and not fused:
        out = out._replace(advantages=masked_whiten(out.advantages, response_mask, eps=_WHITEN_EPS))
    return out


def reinforce_plus_plus(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, *,
                        check_finite: bool = True) -> AdvantageResult:
    """REINFORCE++: discounted token returns, whitened over the batch's valid tokens. [B, T] -> [B, T].

    This is GAE with no critic and lam = 1 (same padding-skipping scan); `returns` are the raw returns.
    """
    return compute_gae(token_level_rewards, None, response_mask, gamma, 1.0, whiten=True, check_finite=check_finite)


# ---------------------------------------------------------------------------------------------- outcome

def as_group_index(index, batch_size: int, device: torch.device | str) -> torch.Tensor:
    """Prompt-group ids as an int64 [B] tensor on `device`: accepts an integer tensor, or a numpy array / list
    of integers or of any hashable ids (e.g. uuid strings, mapped to dense ints)."""
    if isinstance(index, torch.Tensor):
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"`index` must hold integer prompt ids, got a {index.dtype} tensor")
        out = index.to(device=device, dtype=torch.int64)
    else:
        arr = np.asarray(index)
        if arr.dtype.kind not in "iu":
            if arr.dtype.kind == "f":
                raise TypeError(f"`index` must hold integer or string prompt ids, got a {arr.dtype} array")
            arr = np.unique(arr, return_inverse=True)[1].reshape(arr.shape)
        out = torch.as_tensor(arr.astype(np.int64), device=device)
    if out.dim() != 1 or out.numel() != batch_size:
        raise ValueError(f"`index` must have one prompt id per sequence (B={batch_size}), got shape {tuple(out.shape)}")
    return out


def check_outcome(rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, estimator: str, eps: float,
                  baseline: torch.Tensor | None) -> None:
    """What the outcome_advantage kernels check (csrc/include/verl/rl_advantage.h), run on both backends."""
    op = "outcome_advantage"
    check_name(estimator, OUTCOME_ESTIMATORS, "outcome estimator")
    check_bt(rewards, mask, op, "rewards")
    B = rewards.shape[0]
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(f"{op}: `index` (the prompt id of each sequence) must be an integer tensor, got {index.dtype}")
    check_arg(index.device == rewards.device, op, f"`index` is on {index.device} but `rewards` is on "
                                                  f"{rewards.device}; move both to one device")
    check_arg(index.dim() == 1 and index.shape[0] == B, op, f"`index` must be 1-D with one prompt id per sequence "
                                                            f"(B={B}), got shape {list(index.shape)}")
    check_arg(eps >= 0.0, op, f"`eps` must be >= 0, got {eps}")
    check_arg(estimator != "remax" or baseline is not None, op,
              "estimator 'remax' needs `baseline` [B] (the reward of each prompt's greedy response)")
    check_arg(estimator == "remax" or baseline is None, op,
              f"`baseline` is only used by estimator 'remax'; pass None for '{estimator}'")
    if baseline is not None:
        check_floating(baseline, op, "baseline")
        check_arg(baseline.device == rewards.device, op, f"`baseline` is on {baseline.device} but `rewards` is on "
                                                         f"{rewards.device}; move both to one device")
        check_arg(baseline.dim() == 1 and baseline.shape[0] == B, op,
                  f"`baseline` must have shape [B]=[{B}], got {list(baseline.shape)}")


def outcome_advantage_ref(rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, estimator: str,
                          eps: float = 1e-6, norm_by_std: bool = True,
                          baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch outcome advantages: (advantages [B, T], num_nonfinite int64 0-d)."""
    check_outcome(rewards, mask, index, estimator, eps, baseline)
    valid = valid_mask(mask)
    scores = masked_sum_ref(rewards.double(), mask, -1)
    bad = _nonfinite(rewards, mask)
    if estimator == "remax":
        bad = bad + (~torch.isfinite(baseline)).sum()
        adv = scores - baseline.double()
    else:
        _, gid = torch.unique(index, return_inverse=True)
        G = int(gid.max()) + 1
        cnt = torch.zeros(G, dtype=torch.float64, device=rewards.device).index_add_(0, gid, torch.ones_like(scores))
        total = torch.zeros_like(cnt).index_add_(0, gid, scores)
        mean = (total / cnt)[gid]
        n = cnt[gid]
        sq = torch.zeros_like(cnt).index_add_(0, gid, (scores - mean) ** 2)[gid]
        if estimator == "grpo":
            adv = scores - mean
            if norm_by_std:
                adv = adv / (torch.sqrt(sq / (n - 1).clamp(min=1)) + eps)
        elif estimator == "rloo":
            adv = scores - (total[gid] - scores) / (n - 1).clamp(min=1)
        else:
            adv = scores - mean
        adv = torch.where(n >= 2, adv, 0.0)
    out = torch.where(valid, adv.unsqueeze(-1), 0.0).to(rewards.dtype)
    return out, bad


def outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                      estimator: str = "grpo", *, eps: float = 1e-6, norm_by_std: bool = True,
                      baseline: torch.Tensor | None = None, check_finite: bool = True) -> AdvantageResult:
    """Outcome advantages from per-sequence scores (sum of valid token rewards), broadcast over valid tokens.

    token_level_rewards, response_mask: [B, T]; index: [B] prompt ids; baseline: [B] (remax only).
    grpo: (s - group mean) / (group unbiased std + eps), or s - mean with norm_by_std=False (Dr.GRPO);
    rloo: s - mean of the other samples of the group; remax: s - baseline;
    reinforce_plus_plus_baseline: s - group mean, then whitened over the batch's valid tokens.
    `returns` equals `advantages` (no critic).
    """
    check_name(estimator, OUTCOME_ESTIMATORS, "outcome estimator")
    r = token_level_rewards.detach()
    idx = as_group_index(index, r.shape[0] if r.dim() else -1, r.device)
    base = None if baseline is None else baseline.detach().to(r.device)
    check_outcome(r, response_mask, idx, estimator, eps, base)
    if use_fused("outcome_advantage", r):
        adv, bad = torch.ops.verl.outcome_advantage(r, response_mask, idx, estimator, float(eps), bool(norm_by_std),
                                                    base)
    else:
        adv, bad = outcome_advantage_ref(r, response_mask, idx, estimator, eps, norm_by_std, base)
    if check_finite:
        _raise_if_nonfinite(bad, f"token_level_rewards{' or baseline' if base is not None else ''} ({estimator})")
    if estimator == "reinforce_plus_plus_baseline":
        adv = masked_whiten(adv, response_mask)
    return AdvantageResult(adv, adv, bad)


# ------------------------------------------------------------------------- fake implementations

def _fake_bt(x: torch.Tensor, mask: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"expected a 2-D [B, T] tensor, got {tuple(x.shape)}")
    torch._check(x.shape == mask.shape, lambda: f"`mask` must have shape {tuple(x.shape)}, got {tuple(mask.shape)}")


def _fake_gae(rewards, values, mask, gamma, lam, whiten_eps=None):
    _fake_bt(rewards, mask)
    if values is not None:
        torch._check(values.shape == rewards.shape, lambda: "`values` must have the shape of `rewards`")
    new = torch.empty_like(rewards, memory_format=torch.contiguous_format)
    return new, torch.empty_like(new), rewards.new_empty((), dtype=torch.int64)


def _fake_outcome_advantage(rewards, mask, index, estimator, eps, norm_by_std, baseline):
    _fake_bt(rewards, mask)
    torch._check(index.shape == rewards.shape[:1], lambda: "`index` must have shape [B]")
    return torch.empty_like(rewards, memory_format=torch.contiguous_format), rewards.new_empty((), dtype=torch.int64)


if _extension.available():  # advantages take no gradient (rewards, detached values): fake kernels only
    _extension.register_python_parts({"gae": _fake_gae, "outcome_advantage": _fake_outcome_advantage}, {})
