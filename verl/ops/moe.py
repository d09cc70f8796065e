"""Mixture-of-experts token dispatch: tokens to expert-contiguous rows with their routing weights, and back.

    p = moe_permute(hidden, expert_ids, probs, num_experts)    # hidden [T, H], expert_ids / probs [T, K]
    y = experts(p.permuted, p.tokens_per_expert)               # rows of expert 0, then expert 1, ...
    out = moe_unpermute(y, p.dst_of, probs)                    # [T, H] = sum_k probs[t, k] * y[row of (t, k)]

The (token, slot) pairs are ordered by (expert, token, slot) — megatron-core's own order, so its all-to-all
splits describe these rows — and `dst_of[t, k]` is the row of pair (t, k). `permuted_probs` are the weights in
row order (for experts that scale their own output, as megatron-core's do; `moe_unpermute(..., None)` then only
sums). Both ops are differentiable in `hidden`, `probs` and `permuted`; their backwards are gathers as well
(csrc/include/verl/moe.h derives them), so nothing needs a scatter-add or atomics. `*_ref` are the references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_floating

__all__ = ["MoEPermutation", "moe_permute", "moe_unpermute", "moe_permute_ref", "moe_unpermute_ref"]


class MoEPermutation(NamedTuple):
    permuted: torch.Tensor
    """[T*K, H] the tokens' rows in (expert, token, slot) order."""
    permuted_probs: torch.Tensor | None
    """[T*K] the routing weights in that order (None when none were given)."""
    dst_of: torch.Tensor
    """[T, K] int64: the row of pair (t, k)."""
    tokens_per_expert: torch.Tensor
    """[E] int64: rows of each expert (consecutive, expert 0 first)."""


def _check_permute(hidden: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor | None,
                   num_experts: int) -> None:
    op = "moe_permute"
    check_arg(hidden.dim() == 2, op, f"`hidden` must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    check_floating(hidden, op, "hidden")
    check_arg(expert_ids.dim() == 2 and expert_ids.shape[0] == hidden.shape[0], op,
              f"`expert_ids` must be [tokens, top_k] with {hidden.shape[0]} tokens, got {tuple(expert_ids.shape)}")
    check_arg(expert_ids.dtype in (torch.int64, torch.int32), op,
              f"`expert_ids` must be int64 or int32, got {expert_ids.dtype}")
    check_arg(num_experts >= 1, op, f"`num_experts` must be >= 1, got {num_experts}")
    if probs is not None:
        check_floating(probs, op, "probs")
        check_arg(probs.shape == expert_ids.shape, op, f"`probs` must have the shape of `expert_ids` "
                                                       f"{tuple(expert_ids.shape)}, got {tuple(probs.shape)}")


def _check_unpermute(permuted: torch.Tensor, dst_of: torch.Tensor, probs: torch.Tensor | None) -> None:
    op = "moe_unpermute"
    check_arg(permuted.dim() == 2, op, f"`permuted` must be [tokens * top_k, hidden], got {tuple(permuted.shape)}")
    check_floating(permuted, op, "permuted")
    check_arg(dst_of.dim() == 2 and dst_of.dtype == torch.int64 and dst_of.numel() == permuted.shape[0], op,
              f"`dst_of` must be int64 [tokens, top_k] with {permuted.shape[0]} pairs (moe_permute's), got "
              f"{dst_of.dtype} {tuple(dst_of.shape)}")
    if probs is not None:
        check_floating(probs, op, "probs")
        check_arg(probs.shape == dst_of.shape, op, f"`probs` must have the shape of `dst_of` {tuple(dst_of.shape)}, "
                                                   f"got {tuple(probs.shape)}")


# ---------------------------------------------------------------------------------------------- references

def moe_permute_ref(hidden: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor | None,
                    num_experts: int) -> MoEPermutation:
    """Eager PyTorch: a stable argsort of the flattened expert ids gives the row order."""
    _check_permute(hidden, expert_ids, probs, num_experts)
    ids = expert_ids.long()
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"moe_permute: `expert_ids`[{t}, {k}] = {int(ids[t, k])} is not an expert in "
                         f"[0, {num_experts})")
    T, K = ids.shape
    order = ids.reshape(-1).argsort(stable=True)          # pair index of each row
    dst_of = torch.empty_like(order)
    dst_of[order] = torch.arange(order.numel(), device=order.device)
    permuted = hidden[order // K] if K else hidden.new_zeros((0, hidden.shape[1]))
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    pp = None if probs is None else probs.reshape(-1)[order]
    return MoEPermutation(permuted, pp, dst_of.view(T, K), counts)


def moe_unpermute_ref(permuted: torch.Tensor, dst_of: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Eager PyTorch: gather each token's rows and sum them, weighted, in float."""
    _check_unpermute(permuted, dst_of, probs)
    acc = torch.float64 if permuted.dtype == torch.float64 else torch.float32
    rows = permuted[dst_of].to(acc)                        # [T, K, H]
    if probs is not None:
        rows = rows * probs.to(acc)[..., None]
    return rows.sum(1).to(permuted.dtype)


# ---------------------------------------------------------------------------------------- public wrappers

def moe_permute(hidden: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor | None,
                num_experts: int) -> MoEPermutation:
    """Tokens to expert-contiguous rows (see the module docstring); differentiable in hidden and probs."""
    _check_permute(hidden, expert_ids, probs, num_experts)
    if use_fused("moe_permute", hidden):
        permuted, pp, dst_of, counts = torch.ops.verl.moe_permute(hidden, expert_ids, probs, num_experts)
        return MoEPermutation(permuted, None if probs is None else pp, dst_of, counts)
    return moe_permute_ref(hidden, expert_ids, probs, num_experts)


def moe_unpermute(permuted: torch.Tensor, dst_of: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: each token's expert rows summed, weighted by `probs` [T, K] (token order) when given."""
    _check_unpermute(permuted, dst_of, probs)
    if use_fused("moe_unpermute", permuted):
        return torch.ops.verl.moe_unpermute(permuted, dst_of, probs)
    return moe_unpermute_ref(permuted, dst_of, probs)


# ------------------------------------------------------------------------- fake implementations + autograd

def _register() -> None:
    @torch.library.register_fake("verl::moe_permute")
    def _(hidden, expert_ids, probs, num_experts):
        torch._check(hidden.dim() == 2, lambda: "moe_permute: `hidden` must be [tokens, hidden]")
        torch._check(expert_ids.dim() == 2 and expert_ids.shape[0] == hidden.shape[0],
                     lambda: "moe_permute: `expert_ids` must be [tokens, top_k]")
        n = expert_ids.shape[0] * expert_ids.shape[1]
        pp = hidden.new_empty([0], dtype=torch.float32) if probs is None else probs.new_empty([n])
        return (hidden.new_empty([n, hidden.shape[1]]), pp, expert_ids.new_empty(expert_ids.shape, dtype=torch.int64),
                expert_ids.new_empty([num_experts], dtype=torch.int64))

    @torch.library.register_fake("verl::moe_unpermute")
    def _(permuted, dst_of, probs):
        torch._check(dst_of.dim() == 2, lambda: "moe_unpermute: `dst_of` must be [tokens, top_k]")
        return permuted.new_empty([dst_of.shape[0], permuted.shape[1]])

    @torch.library.register_fake("verl::moe_unpermute_backward")
    def _(grad, dst_of, probs, permuted):
        torch._check(probs is None or permuted is not None,
                     lambda: "moe_unpermute_backward: `permuted` is needed for the gradient of `probs`")
        gp = grad.new_empty([0]) if probs is None else probs.new_empty(dst_of.shape)
        return grad.new_empty([dst_of.shape[0] * dst_of.shape[1], grad.shape[1]]), gp

    def permute_setup(ctx, inputs, output):
        _, _, probs, _ = inputs
        ctx.has_probs = probs is not None
        ctx.save_for_backward(output[2])

    def permute_backward(ctx, grad_permuted, grad_pp, _grad_dst, _grad_counts):
        (dst_of,) = ctx.saved_tensors
        grad_hidden = None if grad_permuted is None else torch.ops.verl.moe_unpermute(grad_permuted, dst_of, None)
        grad_probs = None
        if ctx.has_probs and grad_pp is not None and grad_pp.numel():
            grad_probs = grad_pp[dst_of]
        return grad_hidden, None, grad_probs, None

    def unpermute_setup(ctx, inputs, output):
        permuted, dst_of, probs = inputs
        # the rows themselves only matter for the weights' gradient: without weights they are not kept
        ctx.permuted_dtype = permuted.dtype
        ctx.save_for_backward(dst_of, probs, None if probs is None else permuted)

    def unpermute_backward(ctx, grad):
        dst_of, probs, permuted = ctx.saved_tensors
        grad_permuted, grad_probs = torch.ops.verl.moe_unpermute_backward(grad, dst_of, probs, permuted)
        return grad_permuted.to(ctx.permuted_dtype), None, None if probs is None else grad_probs

    torch.library.register_autograd("verl::moe_permute", permute_backward, setup_context=permute_setup)
    torch.library.register_autograd("verl::moe_unpermute", unpermute_backward, setup_context=unpermute_setup)


def _registered() -> bool:
    return _extension.available() and hasattr(torch.ops.verl, "moe_permute")


if _registered():
    _register()
