"""Reshard copies of the 3D-HybridEngine: pack slices into a flat bucket, unpack it, and gather-and-permute
weight blocks (Megatron's fused QKV / gate-up shards → the engine's layout) in one pass.

    flat = reshard_pack([a, b.narrow(1, 0, 3)])             # 1-D bucket, one dtype
    a2, b2 = reshard_unpack(flat, [a.shape, (4, 3)])        # fresh tensors
    out = reshard_gather([s0, s1], plan, dim=0, out_shape=(8, 16))

`plan` is an int64 CPU tensor [n, 4] of rows (source index, source start, out start, length) along `dim`;
every out index along `dim` is written by exactly one row. All copies are byte copies: bit-exact for every
dtype. The kernels are in csrc/cpu/reshard.cpp and csrc/cuda/reshard.cu; `*_ref` are the references.
These ops are not differentiated (weights move outside autograd), so they register no autograd formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verl.ops._backend import use_fused

__all__ = ["reshard_pack", "reshard_unpack", "reshard_gather",
           "reshard_pack_ref", "reshard_unpack_ref", "reshard_gather_ref"]


# ---------------------------------------------------------------------------------------------- references

def _check_bucket(tensors: Sequence[torch.Tensor], op: str) -> None:
    if len(tensors) == 0:
        raise ValueError(f"{op}: `tensors` is empty; pass at least one tensor")
    for i, t in enumerate(tensors):
        if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise ValueError(f"{op}: `tensors[{i}]` is {t.dtype} on {t.device} but `tensors[0]` is "
                             f"{tensors[0].dtype} on {tensors[0].device}; bucket tensors of one dtype and device")


def reshard_pack_ref(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    _check_bucket(tensors, "reshard_pack")
    return torch.cat([t.reshape(-1) for t in tensors])


def _flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    flat, ndims = [], []
    for s in shapes:
        flat.extend(int(d) for d in s)
        ndims.append(len(s))
    return flat, ndims


def reshard_unpack_ref(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    numels = [math.prod(s) for s in shapes]
    if flat.dim() != 1 or sum(numels) != flat.numel():
        raise ValueError(f"reshard_unpack: the shapes hold {sum(numels)} elements but `flat` has shape "
                         f"{tuple(flat.shape)}; the shapes must describe the 1-D bucket exactly")
    return [p.reshape(tuple(s)).clone() for p, s in zip(torch.split(flat, numels), shapes)]


def _check_plan(sources: Sequence[torch.Tensor], plan: torch.Tensor, dim: int, out_shape: Sequence[int]) -> None:
    _check_bucket(sources, "reshard_gather")
    if plan.dtype != torch.int64 or plan.dim() != 2 or plan.shape[1] != 4:
        raise ValueError(f"reshard_gather: `plan` must be int64 [n, 4] (source, source start, out start, length), "
                         f"got {plan.dtype} {tuple(plan.shape)}")
    if not 0 <= dim < len(out_shape):
        raise ValueError(f"reshard_gather: `dim`={dim} is out of range for `out_shape` {tuple(out_shape)}")
    covered = torch.zeros(out_shape[dim], dtype=torch.int64)
    for r, (src, s0, o0, n) in enumerate(plan.tolist()):
        if not 0 <= src < len(sources):
            raise ValueError(f"reshard_gather: plan row {r} names source {src} but there are {len(sources)} sources")
        if n <= 0 or s0 < 0 or s0 + n > sources[src].shape[dim] or o0 < 0 or o0 + n > out_shape[dim]:
            raise ValueError(f"reshard_gather: plan row {r} ({src}, {s0}, {o0}, {n}) is out of range")
        covered[o0:o0 + n] += 1
    if not bool((covered == 1).all()):
        raise ValueError("reshard_gather: the plan must write every out index along `dim` exactly once")


def reshard_gather_ref(sources: Sequence[torch.Tensor], plan: torch.Tensor, dim: int,
                       out_shape: Sequence[int]) -> torch.Tensor:
    _check_plan(sources, plan, dim, out_shape)
    order = sorted(plan.tolist(), key=lambda row: row[2])
    return torch.cat([sources[src].narrow(dim, s0, n) for src, s0, _, n in order], dim=dim).contiguous()


# ---------------------------------------------------------------------------------------- public wrappers

def reshard_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Flattens `tensors` (one dtype and device, any strides) into one 1-D bucket, in order."""
    tensors = list(tensors)
    if tensors and use_fused("reshard_pack", tensors[0]):
        return torch.ops.verl.reshard_pack(tensors)
    return reshard_pack_ref(tensors)


def reshard_unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Splits a 1-D bucket into fresh tensors of `shapes` (the inverse of reshard_pack)."""
    if use_fused("reshard_unpack", flat):
        flat_shapes, ndims = _flatten_shapes(shapes)
        return list(torch.ops.verl.reshard_unpack(flat, flat_shapes, ndims))
    return reshard_unpack_ref(flat, shapes)


def reshard_gather(sources: Sequence[torch.Tensor], plan: torch.Tensor, dim: int,
                   out_shape: Sequence[int]) -> torch.Tensor:
    """A new tensor of `out_shape` assembled from blocks of `sources` along `dim` (see the module doc)."""
    sources = list(sources)
    out_shape = [int(s) for s in out_shape]
    if sources and use_fused("reshard_gather", sources[0]):
        return torch.ops.verl.reshard_gather(sources, plan, dim, out_shape)
    return reshard_gather_ref(sources, plan, dim, out_shape)


# ------------------------------------------------------------------------------------ fake implementations

def _register() -> None:
    @torch.library.register_fake("verl::reshard_pack")
    def _(tensors):
        torch._check(len(tensors) > 0, lambda: "reshard_pack: `tensors` is empty")
        for t in tensors:
            torch._check(t.dtype == tensors[0].dtype, lambda: "reshard_pack: tensors must share one dtype")
        return tensors[0].new_empty([sum(t.numel() for t in tensors)])

    @torch.library.register_fake("verl::reshard_unpack")
    def _(flat, shapes, ndims):
        torch._check(flat.dim() == 1, lambda: "reshard_unpack: `flat` must be 1-D")
        outs, pos = [], 0
        for nd in ndims:
            outs.append(flat.new_empty(list(shapes[pos:pos + nd])))
            pos += nd
        torch._check(sum(o.numel() for o in outs) == flat.numel(),
                     lambda: "reshard_unpack: the shapes must describe the bucket exactly")
        return outs

    @torch.library.register_fake("verl::reshard_gather")
    def _(sources, plan, dim, out_shape):
        torch._check(len(sources) > 0, lambda: "reshard_gather: `sources` is empty")
        torch._check(plan.dtype == torch.int64 and plan.dim() == 2 and plan.shape[1] == 4,
                     lambda: "reshard_gather: `plan` must be int64 [n, 4]")
        torch._check(0 <= dim < len(out_shape), lambda: "reshard_gather: `dim` out of range")
        return sources[0].new_empty(list(out_shape))


def _registered() -> bool:
    from verl import _extension
    return _extension.available() and hasattr(torch.ops.verl, "reshard_pack")


if _registered():
    _register()
