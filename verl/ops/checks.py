"""Argument checks shared by the RL op modules (verl/ops/rl.py, verl/ops/losses.py) and verl.algos: names chosen
from a fixed set, [B, T] tensors with their mask, and the mask as bool."""

from __future__ import annotations

import difflib

import torch

from verl.errors import VerlConfigError

__all__ = ["check_bt", "check_name", "valid_mask"]


def check_name(name: str, known, what: str) -> str:
    """Returns `name` if known, else raises VerlConfigError listing the known names (and the nearest one)."""
    if name in known:
        return name
    near = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise VerlConfigError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")


def check_bt(x: torch.Tensor, mask: torch.Tensor, op: str, name: str) -> None:
    """`x` must be a non-empty floating-point [B, T] tensor and `mask` (bool or real) must have its shape."""
    if not x.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{op}: `{name}` must be 2-D [B, T], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{op}: `{name}` is empty (shape {tuple(x.shape)}); an empty batch has nothing to compute")
    if mask.shape != x.shape:
        raise ValueError(f"{op}: `mask` must have the shape of `{name}` {tuple(x.shape)}, got {tuple(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"{op}: `mask` must be bool or a real dtype (nonzero = valid), got {mask.dtype}")


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask.ne(0)
