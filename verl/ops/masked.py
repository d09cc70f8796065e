"""Masked reductions over valid (mask != 0) positions: sum, mean, variance, whitening.

Every later RL kernel reduces over a response mask; these are also the smallest complete example of the
extension pattern: schema in csrc/ops.cpp, CPU kernel in csrc/cpu/masked.cpp, CUDA kernel in
csrc/cuda/masked.cu, fake + autograd here (the backward is itself an op), and a pure-PyTorch reference.

Conventions (kernel and reference alike):
- `mask` has the shape of `values`, any real dtype, nonzero = valid.
- `dim=None` reduces every element; an int reduces that dimension.
- An all-zero mask (or row) gives 0, never NaN. Variance is unbiased (n - 1) by default and 0 when n <= 1.
- `masked_whiten` uses the unbiased variance (as PPO implementations do) and writes 0 at masked positions.
"""

from __future__ import annotations

import torch

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_floating, check_mask_of

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten",
           "masked_sum_ref", "masked_mean_ref", "masked_var_ref", "masked_whiten_ref"]


# ---------------------------------------------------------------------------------------------- references

def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask.ne(0)


def check_masked(values: torch.Tensor, mask: torch.Tensor, op: str, dim: int | None = None,
                 eps: float | None = None) -> None:
    """What the masked kernels check (csrc/cpu/masked.cpp, csrc/cuda/masked.cu), run on both backends."""
    check_floating(values, op, "values")
    check_mask_of(values, mask, op, "values")
    if dim is not None:
        nd = values.dim()
        check_arg(nd > 0, op, "`dim` given for a 0-d tensor; pass dim=None")
        check_arg(-nd <= dim < nd, op, f"`dim`={dim} is out of range for a tensor with {nd} dimensions")
    if eps is not None:
        check_arg(eps >= 0, op, f"`eps` must be >= 0, got {eps}")


def masked_sum_ref(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    check_masked(values, mask, "masked_sum", dim)
    kept = torch.where(_valid(mask), values, values.new_zeros(()))
    return kept.sum() if dim is None else kept.sum(dim)


def _count(mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    m = _valid(mask)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean_ref(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    check_masked(values, mask, "masked_mean", dim)
    total = masked_sum_ref(values, mask, dim)
    return total / _count(mask, dim).clamp(min=1).to(total.dtype)


def masked_var_ref(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    check_masked(values, mask, "masked_var")
    mean = masked_mean_ref(values, mask)
    sq = masked_sum_ref((values - mean) ** 2, mask)
    n = _count(mask, None)
    denom = (n - 1) if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1).to(sq.dtype), sq.new_zeros(()))


def masked_whiten_ref(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                      eps: float = 1e-8) -> torch.Tensor:
    check_masked(values, mask, "masked_whiten", eps=eps)
    mean = masked_mean_ref(values, mask)
    var = masked_var_ref(values, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_valid(mask), out, out.new_zeros(()))


# ---------------------------------------------------------------------------------------- public wrappers

def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` != 0. values, mask: [...]; returns [] (dim=None) or [...] without `dim`."""
    check_masked(values, mask, "masked_sum", dim)
    if use_fused("masked_sum", values):
        return torch.ops.verl.masked_sum(values, mask, dim)
    return masked_sum_ref(values, mask, dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over `mask` != 0 (0 where nothing is valid). Shapes as masked_sum."""
    check_masked(values, mask, "masked_mean", dim)
    if use_fused("masked_mean", values):
        return torch.ops.verl.masked_mean(values, mask, dim)
    return masked_mean_ref(values, mask, dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of every valid element (0-d result); unbiased (n - 1) by default, 0 when n <= 1."""
    check_masked(values, mask, "masked_var")
    if use_fused("masked_var", values):
        return torch.ops.verl.masked_var(values, mask, unbiased)
    return masked_var_ref(values, mask, unbiased)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the mask (mean added back if not shift_mean); 0 where masked."""
    check_masked(values, mask, "masked_whiten", eps=eps)
    if use_fused("masked_whiten", values):
        return torch.ops.verl.masked_whiten(values, mask, shift_mean, eps)
    return masked_whiten_ref(values, mask, shift_mean, eps)


# ------------------------------------------------------------------------- fake implementations + autograd

def _reduced_shape(values: torch.Tensor, dim: int | None) -> list[int]:
    if dim is None:
        return []
    d = dim % values.dim()
    return [s for i, s in enumerate(values.shape) if i != d]


def _fake_check(values: torch.Tensor, mask: torch.Tensor) -> None:
    torch._check(values.is_floating_point(), lambda: f"`values` must be floating point, got {values.dtype}")
    torch._check(values.shape == mask.shape,
                 lambda: f"`mask` must have the shape of `values` {tuple(values.shape)}, got {tuple(mask.shape)}")


def _fake_reduce(values, mask, dim=None):
    _fake_check(values, mask)
    return values.new_empty(_reduced_shape(values, dim))


def _fake_var(values, mask, unbiased=True):
    _fake_check(values, mask)
    return values.new_empty([])


def _fake_whiten(values, mask, shift_mean=True, eps=1e-8):
    _fake_check(values, mask)
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def _fake_reduce_backward(grad, mask, dim, mean):
    return mask.new_empty(mask.shape, dtype=grad.dtype)


def _fake_like_values(grad, values, mask, *args):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def _setup_reduce(ctx, inputs, output):
    _, mask, dim = inputs
    ctx.save_for_backward(mask)
    ctx.dim = dim


def _sum_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return torch.ops.verl.masked_reduce_backward(grad, mask, ctx.dim, False), None, None


def _mean_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return torch.ops.verl.masked_reduce_backward(grad, mask, ctx.dim, True), None, None


def _setup_var(ctx, inputs, output):
    values, mask, unbiased = inputs
    ctx.save_for_backward(values, mask)
    ctx.unbiased = unbiased


def _var_backward(ctx, grad):
    values, mask = ctx.saved_tensors
    return torch.ops.verl.masked_var_backward(grad, values, mask, ctx.unbiased), None, None


def _setup_whiten(ctx, inputs, output):
    values, mask, shift_mean, eps = inputs
    ctx.save_for_backward(values, mask)
    ctx.shift_mean, ctx.eps = shift_mean, eps


def _whiten_backward(ctx, grad):
    values, mask = ctx.saved_tensors
    return torch.ops.verl.masked_whiten_backward(grad, values, mask, ctx.shift_mean, ctx.eps), None, None, None


_FAKES = {"masked_sum": _fake_reduce, "masked_mean": _fake_reduce, "masked_var": _fake_var,
          "masked_whiten": _fake_whiten, "masked_reduce_backward": _fake_reduce_backward,
          "masked_var_backward": _fake_like_values, "masked_whiten_backward": _fake_like_values}
# op -> (backward, setup_context); each backward is itself an op.
_AUTOGRAD = {"masked_sum": (_sum_backward, _setup_reduce), "masked_mean": (_mean_backward, _setup_reduce),
             "masked_var": (_var_backward, _setup_var), "masked_whiten": (_whiten_backward, _setup_whiten)}


if _extension.available():
    _extension.register_python_parts(_FAKES, _AUTOGRAD)
