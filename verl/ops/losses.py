"""Fused RL losses with masked aggregation: PPO-family policy loss, clipped value loss, KL loss, and plain
aggregation (entropy bonus, any per-token loss); and the per-token KL estimators (kl_penalty) they share.

Kernels: csrc/cpu/rl_loss.cpp and csrc/cuda/rl_loss.cu, driven by csrc/include/verl/rl_loss.h (schemas in
csrc/ops.cpp). When autograd records, a loss op reads its [B, T] inputs once and writes the loss, its
statistics and the gradient (at grad_output = 1) in that one pass; the backward op only scales the saved
gradient by the incoming scalar. The saved gradient costs one [B, T] tensor of the input's dtype until backward.

Aggregation (`Aggregation.mode`), with m the mask and l the per-token loss:
- token-mean:              sum(m*l) / tokens
- seq-mean-token-sum:      sum_b sum_t(m*l) / seqs
- seq-mean-token-mean:     sum_b [sum_t(m*l) / count_b] / seqs
- seq-mean-token-sum-norm: sum_b sum_t(m*l) / (seqs * norm_len)     (Dr.GRPO; norm_len defaults to T)
- token-sum:               sum(m*l)                                   (no normaliser; the loss grows with the batch)
`seqs` counts sequences with at least one valid token. By default tokens/seqs are this batch's counts. For
data-parallel training pass the step's global counts (over every DP rank and micro-batch) and `dp_size`: each
call then returns partial_sum / global_count * dp_size (token-sum: partial_sum * dp_size), so summing
micro-batches and averaging across ranks (as DDP does with gradients) reproduces the full-batch loss and gradient
exactly. Nothing valid gives 0, never NaN.

Statistics (clip fractions, ppo_kl) are token means over this batch's valid tokens, float32.
Gradients flow to `logprob` (policy, KL: also `ref_logprob`) and `values` (value loss); advantages, old
log-probs, old values and returns are treated as constants.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_bt, check_floating, check_like, check_name, valid_mask

__all__ = ["AGG_MODES", "KL_KINDS", "POLICY_LOSSES", "Aggregation", "PolicyLossOutput", "ValueLossOutput",
           "agg_loss", "agg_loss_ref", "kl_loss", "kl_loss_ref", "kl_penalty", "kl_penalty_ref", "policy_loss",
           "policy_loss_ref", "value_loss", "value_loss_ref"]

# Canonical names first; aliases map to them (same spelling as csrc/include/verl/rl_loss.h).
KL_KINDS = {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse", "low_var_kl": "low_var_kl",
            "k3": "low_var_kl", "k1+": "k1+", "kl+": "k1+", "k3+": "k3+", "low_var_kl+": "k3+"}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
POLICY_LOSSES = ("vanilla", "gspo", "reinforce")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Aggregation:
    """How a [B, T] per-token loss becomes one number (see the module docstring)."""

    mode: str = "token-mean"
    """One of AGG_MODES."""
    global_tokens: float | None = None
    """Valid tokens in the whole step (all DP ranks and micro-batches); None: this batch's count."""
    global_seqs: float | None = None
    """Sequences with a valid token in the whole step; None: this batch's count."""
    dp_size: int = 1
    """Data-parallel world size whose gradients are averaged (multiplies the loss when global counts are used)."""
    norm_len: float | None = None
    """seq-mean-token-sum-norm only: the constant each sequence sum is divided by; None: T."""

    def __post_init__(self):
        # The aggregation arguments every loss kernel checks (make_agg in csrc/include/verl/rl_loss.h).
        check_name(self.mode, AGG_MODES, "aggregation mode")
        if int(self.dp_size) < 1:
            raise ValueError(f"Aggregation.dp_size must be >= 1, got {self.dp_size}")
        for name in ("global_tokens", "global_seqs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < math.inf:
                raise ValueError(f"Aggregation.{name} must be a finite count >= 0, got {v}")
        if self.norm_len is not None and not 0 < self.norm_len < math.inf:
            raise ValueError(f"Aggregation.norm_len must be a finite number > 0 (it divides each sequence's token "
                             f"sum), got {self.norm_len}")

    def args(self) -> tuple:
        f = lambda v: None if v is None else float(v)  # noqa: E731
        return (self.mode, f(self.global_tokens), f(self.global_seqs), int(self.dp_size), f(self.norm_len))


def _agg(agg: Aggregation | str | None, mask: torch.Tensor | None = None, op: str = "") -> Aggregation:
    """The Aggregation `agg` names; with `mask`, its global counts checked against the batch they aggregate:
    a global count of 0 while the batch has valid tokens would weigh every row 0, a loss of exactly 0 that
    trains nothing without a word. The mask is read only when a count is 0, so a healthy step never syncs."""
    a = Aggregation() if agg is None else Aggregation(mode=agg) if isinstance(agg, str) else agg
    zero = [n for n in ("global_tokens", "global_seqs") if getattr(a, n) == 0]
    if zero and mask is not None and not torch.compiler.is_compiling():
        n = int(valid_mask(mask).sum())
        check_arg(n == 0, op, f"`{zero[0]}`=0 but `mask` has {n} valid tokens; a global count covers every token "
                              f"of the step (all ranks and micro-batches), so it is at least this batch's; pass the "
                              f"step's count, or None for this batch's")
    return a


# ---------------------------------------------------------------------------------------------- checks
# One per op: what its kernel checks (csrc/include/verl/rl_loss.h), run by the wrapper and the reference alike.

def check_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str, op: str = "kl_penalty") -> None:
    check_name(kind, KL_KINDS, "KL kind")
    check_floating(logprob, op, "logprob")
    check_like(logprob, ref_logprob, op, "logprob", "ref_logprob")


def check_agg_loss(loss: torch.Tensor, mask: torch.Tensor) -> None:
    check_bt(loss, mask, "agg_loss", "loss")


def check_kl_loss(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor, kind: str) -> None:
    check_name(kind, KL_KINDS, "KL kind")
    check_bt(logprob, mask, "kl_loss", "logprob")
    check_like(logprob, ref_logprob, "kl_loss", "logprob", "ref_logprob")


def check_policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, loss_type: str, clip_low: float, clip_high: float, clip_c: float) -> None:
    op = "policy_loss"
    check_name(loss_type, POLICY_LOSSES, "policy loss")
    check_arg(0.0 <= clip_low < 1.0, op, f"`clip_low` must be in [0, 1) (ratio lower bound 1 - clip_low), "
                                         f"got {clip_low}")
    check_arg(clip_high >= 0.0, op, f"`clip_high` must be >= 0, got {clip_high}")
    check_arg(clip_c > 1.0, op, f"`clip_c` (dual-clip constant) must be > 1, got {clip_c}; pass inf to turn dual "
                                f"clip off")
    check_bt(logprob, mask, op, "logprob")
    check_like(logprob, old_logprob, op, "logprob", "old_logprob")
    check_like(logprob, advantages, op, "logprob", "advantages")


def check_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                     clip: float) -> None:
    op = "value_loss"
    check_bt(values, mask, op, "values")
    check_like(values, old_values, op, "values", "old_values")
    check_like(values, returns, op, "values", "returns")
    check_arg(clip >= 0.0, op, f"`clip` (value clip range) must be >= 0, got {clip}; pass inf for no clipping")


class PolicyLossOutput(NamedTuple):
    """loss: 0-d (dtype of logprob); pg_clipfrac, pg_clipfrac_lower, ppo_kl: 0-d float32 statistics."""

    loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor


class ValueLossOutput(NamedTuple):
    """loss: 0-d (dtype of values); vf_clipfrac: 0-d float32."""

    loss: torch.Tensor
    vf_clipfrac: torch.Tensor


# ---------------------------------------------------------------------------------------------- references

def kl_penalty_ref(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || ref). Same shape as the inputs."""
    check_kl_penalty(logprob, ref_logprob, kind)
    kind = KL_KINDS[kind]
    d = logprob - ref_logprob
    if kind == "kl":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "mse":
        return 0.5 * d.square()
    k2 = 0.5 * d.square()
    if kind == "k1+":
        return d.detach() + (k2 - k2.detach())
    dr = torch.clamp(ref_logprob - logprob, -20, 20)
    k3 = torch.clamp(torch.exp(dr) - dr - 1, -10, 10)
    if kind == "low_var_kl":
        return k3
    return k3.detach() + (k2 - k2.detach())


def agg_loss_ref(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation | str | None = None) -> torch.Tensor:
    """Pure-PyTorch aggregation of a [B, T] per-token loss into a 0-d tensor."""
    check_agg_loss(loss, mask)
    a = _agg(agg, mask, "agg_loss")
    valid = valid_mask(mask)
    acc = torch.float64 if loss.dtype == torch.float64 else torch.float32
    x = torch.where(valid, loss.to(acc), 0.0)
    count = valid.sum(-1).to(acc)
    row_sum = x.sum(-1)
    tokens = count.sum() if a.global_tokens is None else x.new_tensor(a.global_tokens)
    seqs = (count > 0).sum().to(acc) if a.global_seqs is None else x.new_tensor(a.global_seqs)
    norm_len = float(loss.shape[-1]) if a.norm_len is None else a.norm_len

    def safe_div(num, den):
        return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)

    if a.mode == "token-mean":
        out = safe_div(row_sum.sum(), tokens)
    elif a.mode == "seq-mean-token-sum":
        out = safe_div(row_sum.sum(), seqs)
    elif a.mode == "seq-mean-token-mean":
        out = safe_div(safe_div(row_sum, count).sum(), seqs)
    elif a.mode == "token-sum":
        out = row_sum.sum()
    else:
        out = safe_div(row_sum.sum(), seqs * norm_len)
    return (out * a.dp_size).to(loss.dtype)


def _token_mean_stat(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    n = valid.sum()
    return (torch.where(valid, x.float(), 0.0).sum() / n.clamp(min=1)).float()


def policy_loss_ref(logprob, old_logprob, advantages, mask, loss_type: str = "vanilla", clip_low: float = 0.2,
                    clip_high: float = 0.2, clip_c: float = 3.0,
                    agg: Aggregation | str | None = None) -> PolicyLossOutput:
    """Pure-PyTorch PPO-family policy loss (the usual formulation, op by op)."""
    check_policy_loss(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c)
    valid = valid_mask(mask)
    neg_kl = logprob - old_logprob
    if loss_type == "gspo":
        count = valid.sum(-1).clamp(min=1)
        seq_lr = torch.where(valid, neg_kl, 0.0).sum(-1) / count
        log_ratio = logprob - logprob.detach() + seq_lr.detach().unsqueeze(-1)
    else:
        log_ratio = neg_kl
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    pg1 = -advantages * ratio
    zero = torch.zeros((), dtype=torch.float32, device=logprob.device)
    if loss_type == "reinforce":
        per_token, clipped, lower = pg1, zero, zero
    else:
        pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        clip1 = torch.maximum(pg1, pg2)
        clipped = _token_mean_stat(torch.gt(pg2, pg1), valid)
        if loss_type == "gspo":
            per_token, lower = clip1, zero
        else:
            pg3 = -advantages * clip_c
            clip2 = torch.minimum(pg3, clip1)
            per_token = torch.where(advantages < 0, clip2, clip1)
            lower = _token_mean_stat(torch.gt(clip1, pg3) & (advantages < 0), valid)
    ppo_kl = _token_mean_stat(-torch.clamp(neg_kl, -20.0, 20.0).detach(), valid)
    return PolicyLossOutput(agg_loss_ref(per_token, mask, agg), clipped, lower, ppo_kl)


def value_loss_ref(values, old_values, returns, mask, clip: float = 0.5,
                   agg: Aggregation | str | None = None) -> ValueLossOutput:
    """Pure-PyTorch clipped value loss: 0.5 * max((v - R)^2, (clip(v, old +- clip) - R)^2), aggregated."""
    check_value_loss(values, old_values, returns, mask, clip)
    vc = torch.clamp(values, old_values - clip, old_values + clip)
    l1 = (values - returns).square()
    l2 = (vc - returns).square()
    loss = 0.5 * torch.maximum(l1, l2)
    return ValueLossOutput(agg_loss_ref(loss, mask, agg), _token_mean_stat(torch.gt(l2, l1), valid_mask(mask)))


def kl_loss_ref(logprob, ref_logprob, mask, kind: str = "low_var_kl",
                agg: Aggregation | str | None = None) -> torch.Tensor:
    check_kl_loss(logprob, ref_logprob, mask, kind)
    return agg_loss_ref(kl_penalty_ref(logprob, ref_logprob, kind), mask, agg)


# ---------------------------------------------------------------------------------------------- public wrappers
#
# The loss ops compute d loss / d input in the forward pass only when it will be used (`with_grad`): when
# autograd records and an input requires grad.

def _wants_grad(*xs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL penalty, [...] -> [...]: kl/k1 (logp - ref), abs, mse/k2 (0.5 d^2), low_var_kl/k3
    (exp(ref - logp) - (ref - logp) - 1, argument clamped to +-20, result to +-10), and straight-through k1+ / k3+
    (value of k1 / k3, gradient of k2). Differentiable in both inputs."""
    check_kl_penalty(logprob, ref_logprob, kind)
    if use_fused("kl_penalty", logprob, ref_logprob):
        return torch.ops.verl.kl_penalty(logprob, ref_logprob, kind)
    return kl_penalty_ref(logprob, ref_logprob, kind)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation | str | None = None) -> torch.Tensor:
    """Aggregates a per-token loss [B, T] over `mask` [B, T] into a 0-d tensor (e.g. the entropy bonus)."""
    check_agg_loss(loss, mask)
    a = _agg(agg, mask, "agg_loss")
    if use_fused("agg_loss", loss):
        return torch.ops.verl.agg_loss(loss, mask, *a.args())[0]
    return agg_loss_ref(loss, mask, a)


def kl_loss(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor, kind: str = "low_var_kl",
            agg: Aggregation | str | None = None) -> torch.Tensor:
    """KL penalty (see verl.ops.kl_penalty for the kinds) fused with masked aggregation: [B, T] x2 -> 0-d."""
    check_kl_loss(logprob, ref_logprob, mask, kind)
    a = _agg(agg, mask, "kl_loss")
    if use_fused("kl_loss", logprob, ref_logprob):
        with_grad = _wants_grad(logprob, ref_logprob)
        return torch.ops.verl.kl_loss(logprob, ref_logprob, mask, kind, *a.args(), with_grad)[0]
    return kl_loss_ref(logprob, ref_logprob, mask, kind, a)


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                loss_type: str = "vanilla", *, clip_low: float = 0.2, clip_high: float | None = None,
                clip_c: float = 3.0, agg: Aggregation | str | None = None) -> PolicyLossOutput:
    """PPO-family policy loss; logprob, old_logprob, advantages, mask: [B, T].

    vanilla: ratio = exp(clamp(logp - old, +-20)); max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for
    A < 0 the dual clip min(., -A clip_c). gspo: the same clip on the sequence ratio exp(mean_t(logp - old))
    carried per token with a stop-gradient (token-level gradient), no dual clip. reinforce: -A r, unclipped
    (on-policy its gradient is -A grad logp). clip_high defaults to clip_low.
    """
    ch = clip_low if clip_high is None else clip_high
    check_policy_loss(logprob, old_logprob, advantages, mask, loss_type, clip_low, ch, clip_c)
    a = _agg(agg, mask, "policy_loss")
    if use_fused("policy_loss", logprob):
        out = torch.ops.verl.policy_loss(logprob, old_logprob.detach(), advantages.detach(), mask, loss_type,
                                         float(clip_low), float(ch), float(clip_c), *a.args(), _wants_grad(logprob))
        return PolicyLossOutput(*out[:4])
    return policy_loss_ref(logprob, old_logprob.detach(), advantages.detach(), mask, loss_type, clip_low, ch, clip_c, a)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5, *, agg: Aggregation | str | None = None) -> ValueLossOutput:
    """Clipped value loss 0.5 * max((v - R)^2, (old + clamp(v - old, +-clip) - R)^2) aggregated; [B, T] -> 0-d."""
    check_value_loss(values, old_values, returns, mask, clip)
    a = _agg(agg, mask, "value_loss")
    if use_fused("value_loss", values):
        out = torch.ops.verl.value_loss(values, old_values.detach(), returns.detach(), mask, float(clip), *a.args(),
                                        _wants_grad(values))
        return ValueLossOutput(*out[:2])
    return value_loss_ref(values, old_values.detach(), returns.detach(), mask, clip, a)


# ---------------------------------------------------------------------------------------------- fake implementations

def _fake_like(ref: torch.Tensor, *others: torch.Tensor) -> None:
    torch._check(ref.dim() == 2, lambda: f"expected a 2-D [B, T] tensor, got {tuple(ref.shape)}")
    for o in others:
        torch._check(o.shape == ref.shape, lambda o=o: f"shape {tuple(o.shape)} != {tuple(ref.shape)}")


def _scalar(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty((), dtype=dtype or like.dtype)


def _grad_out(x: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """The loss ops' gradient output: [B, T] with_grad, else an empty [0]."""
    return torch.empty_like(x, memory_format=torch.contiguous_format) if with_grad else x.new_empty((0,))


def _fake_kl_penalty(logprob, ref_logprob, kind):
    torch._check(logprob.shape == ref_logprob.shape, lambda: "`ref_logprob` must have the shape of `logprob`")
    return torch.empty_like(logprob, memory_format=torch.contiguous_format)


def _fake_kl_penalty_backward(grad, logprob, ref_logprob, kind):
    return torch.empty_like(logprob, memory_format=torch.contiguous_format)


def _fake_agg_loss(loss, mask, mode, global_tokens, global_seqs, dp_size, norm_len):
    _fake_like(loss, mask)
    return _scalar(loss), loss.new_empty((loss.shape[0],), dtype=torch.float64)


def _fake_agg_loss_backward(grad, mask, row_weight):
    return mask.new_empty(mask.shape, dtype=grad.dtype)


def _fake_kl_loss(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size, norm_len, with_grad):
    _fake_like(logprob, ref_logprob, mask)
    return _scalar(logprob), _grad_out(logprob, with_grad)


def _fake_policy_loss(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c, mode,
                      global_tokens, global_seqs, dp_size, norm_len, with_grad):
    _fake_like(logprob, old_logprob, advantages, mask)
    f32 = torch.float32
    return (_scalar(logprob), _scalar(logprob, f32), _scalar(logprob, f32), _scalar(logprob, f32),
            _grad_out(logprob, with_grad))


def _fake_value_loss(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs, dp_size, norm_len,
                     with_grad):
    _fake_like(values, old_values, returns, mask)
    return _scalar(values), _scalar(values, torch.float32), _grad_out(values, with_grad)


def _fake_loss_grad_scale(grad, saved_grad):
    torch._check(grad.numel() == 1, lambda: f"`grad` must be the scalar loss's gradient, got {tuple(grad.shape)}")
    return torch.empty_like(saved_grad)


# ---------------------------------------------------------------------------------------------- autograd
#
# agg_loss's autograd kernel is C++ (csrc/cpu/rl_loss.cpp: it saves the row weights; its backward op is
# agg_loss_backward): the op is cheap enough that the Python wrapper's fixed cost dominated it.

def _setup_kl_penalty(ctx, inputs, output):
    logprob, ref_logprob, kind = inputs
    ctx.save_for_backward(logprob, ref_logprob)
    ctx.kind = kind


def _kl_penalty_backward(ctx, grad):
    logprob, ref_logprob = ctx.saved_tensors
    g = torch.ops.verl.kl_penalty_backward(grad, logprob, ref_logprob, ctx.kind)
    # Every estimator is a function of logprob - ref_logprob, so the reference gets the negated gradient.
    return g, (-g if ctx.needs_input_grad[1] else None), None


# kl_loss, policy_loss, value_loss: the last output is d loss / d (first input) at grad_output = 1, written by the
# forward when called with_grad (their last argument); backward scales it by the incoming gradient.
def _setup_saved_grad(ctx, inputs, output):
    ctx.save_for_backward(output[-1])
    ctx.mark_non_differentiable(*output[1:])
    ctx.with_grad = inputs[-1]


def _saved_grad_backward(op: str, ref_sign: int | None):
    """Backward of a loss op; ref_sign: the sign of d / d (second input) (kl_loss: -1), None if not differentiable."""
    def backward(ctx, grad, *_unused):
        if not ctx.with_grad:
            raise RuntimeError(f"verl::{op} was called with with_grad=False, so it saved no gradient to "
                               f"differentiate; call it with with_grad=True (verl.ops.{op} does when autograd records)")
        (saved,) = ctx.saved_tensors
        g = torch.ops.verl.loss_grad_scale(grad, saved)
        out = [None] * len(ctx.needs_input_grad)
        out[0] = g if ctx.needs_input_grad[0] else None
        if ref_sign is not None and ctx.needs_input_grad[1]:
            out[1] = g if ref_sign > 0 else -g
        return tuple(out)
    return backward


_FAKES = {"kl_penalty": _fake_kl_penalty, "kl_penalty_backward": _fake_kl_penalty_backward,
          "agg_loss": _fake_agg_loss, "agg_loss_backward": _fake_agg_loss_backward, "kl_loss": _fake_kl_loss,
          "policy_loss": _fake_policy_loss, "value_loss": _fake_value_loss, "loss_grad_scale": _fake_loss_grad_scale}


# The KL estimators depend on logprob - ref_logprob only: d / d ref = -d / d logprob.
_AUTOGRAD = {"kl_penalty": (_kl_penalty_backward, _setup_kl_penalty),
             **{op: (_saved_grad_backward(op, ref_sign), _setup_saved_grad)
                for op, ref_sign in (("kl_loss", -1), ("policy_loss", None), ("value_loss", None))}}

if _extension.available():
    _extension.register_python_parts(_FAKES, _AUTOGRAD)
