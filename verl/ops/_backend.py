"""Choosing between the fused kernels (torch.ops.verl.*) and the pure-PyTorch references: one switch.

    verl.ops.set_backend("reference")      # or "fused" (error if a kernel is missing) or "auto" (default)
    with verl.ops.backend("reference"): ...
    VERL_OPS_BACKEND=reference python train.py

"auto" uses a fused kernel when one is registered for the tensors' device and otherwise falls back to the
reference with a one-time warning. The decision is a dict lookup, so it is free and traceable by
torch.compile (no graph break).
"""

from __future__ import annotations

import contextlib
import os

import torch

from verl import _extension

BACKENDS = ("auto", "fused", "reference")


def _validated(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown verl.ops backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


_state = {"backend": _validated(os.environ.get("VERL_OPS_BACKEND", "auto") or "auto")}
# (op, dispatch key) -> kernel registered; filled once at import, so lookups stay traceable.
_KERNELS: dict[tuple[str, str], bool] = {(op, key): _extension.has_kernel(op, key)
                                         for op in _extension.op_names() for key in ("CPU", "CUDA")}


def get_backend() -> str:
    return _state["backend"]


def set_backend(name: str) -> None:
    """Sets the process-wide choice: "auto", "fused" or "reference"."""
    _state["backend"] = _validated(name)


@contextlib.contextmanager
def backend(name: str):
    """Temporarily switches the backend (restored on exit)."""
    old = _state["backend"]
    _state["backend"] = _validated(name)
    try:
        yield
    finally:
        _state["backend"] = old


def use_fused(op: str, *tensors: torch.Tensor) -> bool:
    """True when `op` should run the fused kernel for these tensors."""
    mode = _state["backend"]
    if mode == "reference":
        return False
    key = "CUDA" if any(t.is_cuda for t in tensors) else "CPU"
    if _KERNELS.get((op, key), False):
        return True
    if not _extension.available():
        why = "the extension verl._C is not built or failed to import"
    elif key == "CUDA" and not _extension.built_with_cuda():
        why = "verl._C was built without CUDA kernels (CUDA tensors given)"
    else:
        why = f"verl._C has no {key} kernel for verl::{op}"
    if mode == "fused":
        raise RuntimeError(f"verl.ops backend is 'fused' but {why}; {_extension.BUILD_HINT}")
    _extension.warn_fallback(why)
    return False
