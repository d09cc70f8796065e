"""Argument checks shared by the op modules (verl/ops/*.py) and verl.algos.

They mirror csrc/include/verl/checks.h and rl.h check for check, with the same wording: each op's wrapper runs
its one check function before choosing a backend, so the fused kernels and the pure-PyTorch references refuse
exactly the same inputs with the same error (the kernels keep their TORCH_CHECKs for direct
`torch.ops.verl.*` callers). Wrong dtypes raise TypeError; wrong shapes, devices and out-of-range numbers
raise ValueError. Every message starts with the op and names the argument in backquotes.
"""

from __future__ import annotations

import difflib

import torch

from verl.errors import VerlConfigError

__all__ = ["check_arg", "check_bt", "check_floating", "check_like", "check_mask_of", "check_name",
           "check_same_device", "check_same_shape", "valid_mask"]


def check_name(name: str, known, what: str) -> str:
    """Returns `name` if known, else raises VerlConfigError listing the known names (and the nearest one)."""
    if name in known:
        return name
    near = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise VerlConfigError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")


def check_arg(ok: bool, op: str, message: str) -> None:
    """ValueError '{op}: {message}' unless `ok` (write range checks so that NaN makes `ok` False)."""
    if not ok:
        raise ValueError(f"{op}: {message}")


def check_floating(t: torch.Tensor, op: str, name: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor (float32, float64, bfloat16 or float16), "
                        f"got {t.dtype}")


def check_same_device(a: torch.Tensor, b: torch.Tensor, op: str, a_name: str, b_name: str) -> None:
    check_arg(a.device == b.device, op, f"`{b_name}` is on {b.device} but `{a_name}` is on {a.device}; "
                                        f"move both to one device")


def check_same_shape(a: torch.Tensor, b: torch.Tensor, op: str, a_name: str, b_name: str) -> None:
    # No broadcasting: a silently broadcast mask or advantage is the classic source of wrong RL losses.
    check_arg(a.shape == b.shape, op, f"`{b_name}` must have the shape of `{a_name}` {list(a.shape)}, "
                                      f"got {list(b.shape)}")


def check_like(ref: torch.Tensor, t: torch.Tensor, op: str, ref_name: str, name: str) -> None:
    """`t` matches `ref` in device, shape and dtype (no silent broadcasting or casting of loss inputs)."""
    check_same_device(ref, t, op, ref_name, name)
    check_same_shape(ref, t, op, ref_name, name)
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: `{name}` must have the dtype of `{ref_name}` ({ref.dtype}), got {t.dtype}; "
                        f"cast it with .to({ref_name}.dtype)")


def check_mask_of(ref: torch.Tensor, mask: torch.Tensor, op: str, ref_name: str) -> None:
    """`mask` marks valid positions of `ref`: same device and shape, bool or any real dtype (nonzero = valid)."""
    check_same_device(ref, mask, op, ref_name, "mask")
    check_same_shape(ref, mask, op, ref_name, "mask")
    if mask.is_complex():
        raise TypeError(f"{op}: `mask` must be bool or a real dtype (nonzero = valid), got {mask.dtype}")


def check_bt(x: torch.Tensor, mask: torch.Tensor, op: str, name: str) -> None:
    """`x` is a non-empty floating-point [B, T] tensor and `mask` is its mask (check_mask_of)."""
    check_floating(x, op, name)
    check_arg(x.dim() == 2, op, f"`{name}` must be 2-D [B, T] (sequences x response tokens), got shape "
                                f"{list(x.shape)}")
    check_arg(x.numel() > 0, op, f"`{name}` is empty (shape {list(x.shape)}); an empty batch has nothing to "
                                 f"compute: skip the step, or check that the rollout produced tokens")
    check_mask_of(x, mask, op, name)


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask.ne(0)
