"""Fused RL losses with masked aggregation: PPO-family policy loss, clipped value loss, KL loss, and plain
aggregation (entropy bonus, any per-token loss). Each forward reads its [B, T] inputs once and produces the
loss and its statistics; each backward writes the gradient in one pass.

Aggregation (`Aggregation.mode`), with m the mask and l the per-token loss:
- token-mean:              sum(m*l) / tokens
- seq-mean-token-sum:      sum_b sum_t(m*l) / seqs
- seq-mean-token-mean:     sum_b [sum_t(m*l) / count_b] / seqs
- seq-mean-token-sum-norm: sum_b sum_t(m*l) / (seqs * norm_len)     (Dr.GRPO; norm_len defaults to T)
`seqs` counts sequences with at least one valid token. By default tokens/seqs are this batch's counts. For
data-parallel training pass the step's global counts (over every DP rank and micro-batch) and `dp_size`: each
call then returns partial_sum / global_count * dp_size, so summing micro-batches and averaging across ranks (as
DDP does with gradients) reproduces the full-batch loss and gradient exactly. Nothing valid gives 0, never NaN.

Statistics (clip fractions, ppo_kl) are token means over this batch's valid tokens, float32.
Gradients flow to `logprob` (policy, KL: also `ref_logprob`) and `values` (value loss); advantages, old
log-probs, old values and returns are treated as constants.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.rl import KL_KINDS, _check_bt, _valid, check_name, kl_penalty_ref

__all__ = ["AGG_MODES", "POLICY_LOSSES", "Aggregation", "PolicyLossOutput", "ValueLossOutput", "agg_loss",
           "agg_loss_ref", "kl_loss", "kl_loss_ref", "policy_loss", "policy_loss_ref", "value_loss", "value_loss_ref"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
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
        check_name(self.mode, AGG_MODES, "aggregation mode")
        if int(self.dp_size) < 1:
            raise ValueError(f"Aggregation.dp_size must be >= 1, got {self.dp_size}")
        for name in ("global_tokens", "global_seqs"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"Aggregation.{name} must be a count >= 0, got {v}")
        if self.norm_len is not None and not self.norm_len > 0:
            raise ValueError(f"Aggregation.norm_len must be > 0, got {self.norm_len}")

    def args(self) -> tuple:
        f = lambda v: None if v is None else float(v)  # noqa: E731
        return (self.mode, f(self.global_tokens), f(self.global_seqs), int(self.dp_size), f(self.norm_len))


def _agg(agg: Aggregation | str | None) -> Aggregation:
    if agg is None:
        return Aggregation()
    if isinstance(agg, str):
        return Aggregation(mode=agg)
    return agg


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

def agg_loss_ref(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation | str | None = None) -> torch.Tensor:
    """Pure-PyTorch aggregation of a [B, T] per-token loss into a 0-d tensor."""
    a = _agg(agg)
    _check_bt(loss, mask, "agg_loss", "loss")
    valid = _valid(mask)
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
    check_name(loss_type, POLICY_LOSSES, "policy loss")
    valid = _valid(mask)
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
    vc = torch.clamp(values, old_values - clip, old_values + clip)
    l1 = (values - returns).square()
    l2 = (vc - returns).square()
    loss = 0.5 * torch.maximum(l1, l2)
    return ValueLossOutput(agg_loss_ref(loss, mask, agg), _token_mean_stat(torch.gt(l2, l1), _valid(mask)))


def kl_loss_ref(logprob, ref_logprob, mask, kind: str = "low_var_kl",
                agg: Aggregation | str | None = None) -> torch.Tensor:
    return agg_loss_ref(kl_penalty_ref(logprob, ref_logprob, kind), mask, agg)


# ---------------------------------------------------------------------------------------------- public wrappers
#
# With autograd recording and a differentiable input, the wrappers call the ops' *_with_grad forms: they
# write d loss / d input (at grad_output = 1) in the same pass over memory as the loss, and the backward op
# only scales it (one pass over the inputs for forward + backward, instead of one each). The saved gradient
# costs one [B, T] tensor of the input's dtype until backward. Without grad the plain forward ops run.

def _wants_grad(*xs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation | str | None = None) -> torch.Tensor:
    """Aggregates a per-token loss [B, T] over `mask` [B, T] into a 0-d tensor (e.g. the entropy bonus)."""
    a = _agg(agg)
    if use_fused("agg_loss", loss):
        return torch.ops.verl.agg_loss(loss, mask, *a.args())[0]
    return agg_loss_ref(loss, mask, a)


def kl_loss(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor, kind: str = "low_var_kl",
            agg: Aggregation | str | None = None) -> torch.Tensor:
    """KL penalty (see verl.ops.kl_penalty for the kinds) fused with masked aggregation: [B, T] x2 -> 0-d."""
    check_name(kind, KL_KINDS, "KL kind")
    a = _agg(agg)
    if use_fused("kl_loss", logprob, ref_logprob):
        if _wants_grad(logprob, ref_logprob):
            return torch.ops.verl.kl_loss_with_grad(logprob, ref_logprob, mask, kind, *a.args())[0]
        return torch.ops.verl.kl_loss(logprob, ref_logprob, mask, kind, *a.args())[0]
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
    check_name(loss_type, POLICY_LOSSES, "policy loss")
    a = _agg(agg)
    ch = clip_low if clip_high is None else clip_high
    if use_fused("policy_loss", logprob):
        op = torch.ops.verl.policy_loss_with_grad if _wants_grad(logprob) else torch.ops.verl.policy_loss
        out = op(logprob, old_logprob.detach(), advantages.detach(), mask, loss_type, float(clip_low), float(ch),
                 float(clip_c), *a.args())
        return PolicyLossOutput(*out[:4])
    return policy_loss_ref(logprob, old_logprob.detach(), advantages.detach(), mask, loss_type, clip_low, ch, clip_c, a)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5, *, agg: Aggregation | str | None = None) -> ValueLossOutput:
    """Clipped value loss 0.5 * max((v - R)^2, (old + clamp(v - old, +-clip) - R)^2) aggregated; [B, T] -> 0-d."""
    a = _agg(agg)
    if use_fused("value_loss", values):
        op = torch.ops.verl.value_loss_with_grad if _wants_grad(values) else torch.ops.verl.value_loss
        out = op(values, old_values.detach(), returns.detach(), mask, float(clip), *a.args())
        return ValueLossOutput(*out[:2])
    return value_loss_ref(values, old_values.detach(), returns.detach(), mask, clip, a)


# ------------------------------------------------------------------------- fake implementations + autograd

def _register() -> None:
    lib = "verl::"

    def _fake_like(ref, *others):
        torch._check(ref.dim() == 2, lambda: f"expected a 2-D [B, T] tensor, got {tuple(ref.shape)}")
        for o in others:
            torch._check(o.shape == ref.shape, lambda o=o: f"shape {tuple(o.shape)} != {tuple(ref.shape)}")

    def _scalar(like, dtype=None):
        return like.new_empty((), dtype=dtype or like.dtype)

    def _rw(like):
        return like.new_empty((like.shape[0],), dtype=torch.float64)

    def _grad_like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "agg_loss")
    def _(loss, mask, mode, global_tokens, global_seqs, dp_size, norm_len):
        _fake_like(loss, mask)
        return _scalar(loss), _rw(loss)

    @torch.library.register_fake(lib + "agg_loss_backward")
    def _(grad, mask, row_weight):
        return mask.new_empty(mask.shape, dtype=grad.dtype)

    @torch.library.register_fake(lib + "kl_loss")
    def _(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size, norm_len):
        _fake_like(logprob, ref_logprob, mask)
        return _scalar(logprob), _rw(logprob)

    @torch.library.register_fake(lib + "kl_loss_backward")
    def _(grad, logprob, ref_logprob, mask, row_weight, kind):
        return _grad_like(logprob)

    @torch.library.register_fake(lib + "policy_loss")
    def _(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c, mode, global_tokens,
          global_seqs, dp_size, norm_len):
        _fake_like(logprob, old_logprob, advantages, mask)
        f32 = torch.float32
        return _scalar(logprob), _scalar(logprob, f32), _scalar(logprob, f32), _scalar(logprob, f32), _rw(logprob)

    @torch.library.register_fake(lib + "policy_loss_backward")
    def _(grad, logprob, old_logprob, advantages, mask, row_weight, loss_type, clip_low, clip_high, clip_c):
        return _grad_like(logprob)

    @torch.library.register_fake(lib + "value_loss")
    def _(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs, dp_size, norm_len):
        _fake_like(values, old_values, returns, mask)
        return _scalar(values), _scalar(values, torch.float32), _rw(values)

    @torch.library.register_fake(lib + "value_loss_backward")
    def _(grad, values, old_values, returns, mask, row_weight, clip):
        return _grad_like(values)

    @torch.library.register_fake(lib + "kl_loss_with_grad")
    def _(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size, norm_len):
        _fake_like(logprob, ref_logprob, mask)
        return _scalar(logprob), _grad_like(logprob)

    @torch.library.register_fake(lib + "policy_loss_with_grad")
    def _(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c, mode, global_tokens,
          global_seqs, dp_size, norm_len):
        _fake_like(logprob, old_logprob, advantages, mask)
        f32 = torch.float32
        return (_scalar(logprob), _scalar(logprob, f32), _scalar(logprob, f32), _scalar(logprob, f32),
                _grad_like(logprob))

    @torch.library.register_fake(lib + "value_loss_with_grad")
    def _(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs, dp_size, norm_len):
        _fake_like(values, old_values, returns, mask)
        return _scalar(values), _scalar(values, torch.float32), _grad_like(values)

    @torch.library.register_fake(lib + "loss_grad_scale")
    def _(grad, saved_grad):
        torch._check(grad.numel() == 1, lambda: f"`grad` must be the scalar loss's gradient, got {tuple(grad.shape)}")
        return torch.empty_like(saved_grad)

    # *_with_grad: the last output is d loss / d input at grad_output = 1; backward scales it.
    def _setup_with_grad(ctx, inputs, output):
        ctx.save_for_backward(output[-1])
        ctx.mark_non_differentiable(*output[1:])

    def _with_grad_backward(n_inputs, signs):
        def backward(ctx, grad, *_unused):
            (saved,) = ctx.saved_tensors
            g = torch.ops.verl.loss_grad_scale(grad, saved)
            out = [None] * n_inputs
            for i, sign in enumerate(signs):
                if ctx.needs_input_grad[i]:
                    out[i] = g if sign > 0 else -g
            return tuple(out)
        return backward

    torch.library.register_autograd(lib + "policy_loss_with_grad", _with_grad_backward(13, (1,)),
                                    setup_context=_setup_with_grad)
    torch.library.register_autograd(lib + "value_loss_with_grad", _with_grad_backward(10, (1,)),
                                    setup_context=_setup_with_grad)
    # The KL estimators depend on logprob - ref_logprob only: d/d ref = -d/d logprob.
    torch.library.register_autograd(lib + "kl_loss_with_grad", _with_grad_backward(9, (1, -1)),
                                    setup_context=_setup_with_grad)

    # Each forward returns row_weight [B] (float64) so that backward is one elementwise pass. agg_loss's autograd
    # kernel is C++ (csrc/cpu/rl.cpp, same saved tensors and backward op): this op is cheap enough that the Python
    # wrapper's fixed cost dominated it.

    def _setup_kl(ctx, inputs, output):
        logprob, ref_logprob, mask, kind = inputs[:4]
        ctx.save_for_backward(logprob, ref_logprob, mask, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.kind = kind

    def _kl_backward(ctx, grad, _grad_rw):
        logprob, ref_logprob, mask, rw = ctx.saved_tensors
        g = torch.ops.verl.kl_loss_backward(grad, logprob, ref_logprob, mask, rw, ctx.kind)
        return (g, -g if ctx.needs_input_grad[1] else None) + (None,) * 7

    torch.library.register_autograd(lib + "kl_loss", _kl_backward, setup_context=_setup_kl)

    def _setup_pg(ctx, inputs, output):
        logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c = inputs[:8]
        ctx.save_for_backward(logprob, old_logprob, advantages, mask, output[4])
        ctx.mark_non_differentiable(*output[1:])
        ctx.params = (loss_type, clip_low, clip_high, clip_c)

    def _pg_backward(ctx, grad, *_unused):
        logprob, old_logprob, advantages, mask, rw = ctx.saved_tensors
        g = torch.ops.verl.policy_loss_backward(grad, logprob, old_logprob, advantages, mask, rw, *ctx.params)
        return (g,) + (None,) * 12

    torch.library.register_autograd(lib + "policy_loss", _pg_backward, setup_context=_setup_pg)

    def _setup_vf(ctx, inputs, output):
        values, old_values, returns, mask, clip = inputs[:5]
        ctx.save_for_backward(values, old_values, returns, mask, output[2])
        ctx.mark_non_differentiable(*output[1:])
        ctx.clip = clip

    def _vf_backward(ctx, grad, *_unused):
        values, old_values, returns, mask, rw = ctx.saved_tensors
        g = torch.ops.verl.value_loss_backward(grad, values, old_values, returns, mask, rw, ctx.clip)
        return (g,) + (None,) * 9

    torch.library.register_autograd(lib + "value_loss", _vf_backward, setup_context=_setup_vf)


if _extension.available():
    _register()
