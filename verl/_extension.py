"""Loads the compiled extension `verl._C` (csrc/) once and says what it was built with.

When the extension is missing, broken, or lacks a backend for the tensors at hand, verl.ops falls back
to its pure-PyTorch references and warns once, naming the command that builds the extension (and the test
suite's strict mode, tests/environments.py, fails naming the import error instead of skipping).

`VERL_EXTENSION_PATH=<file>` loads `verl._C` from that shared library instead of the package's own: a build kept
elsewhere (scripts/setup_env.sh checks the CUDA build in build/cuda/lib this way), or a missing / broken file to
see what a failed import does.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import torch

BUILD_HINT = ("build it with `pip install --no-build-isolation -e .` in the repository "
              "(or `bash scripts/setup_env.sh dev`); `verl doctor` checks the toolchain")


@functools.lru_cache(maxsize=None)
def load() -> object | None:
    """The imported `verl._C` module, or None (the import error is kept in `load_error()`)."""
    try:
        path = os.environ.get("VERL_EXTENSION_PATH")
        if path:
            return _load_file(path)
        from verl import _C  # noqa: F401  (importing registers torch.ops.verl.*)
    except Exception as e:  # noqa: BLE001 - any failure means "no extension", reported by doctor
        _errors.append(e)
        return None
    return _C


def _load_file(path: str) -> object:
    """`verl._C` from the shared library at `path` (VERL_EXTENSION_PATH)."""
    if not os.path.isfile(path):
        raise ImportError(f"VERL_EXTENSION_PATH={path!r}: no such file")
    loader = importlib.machinery.ExtensionFileLoader("verl._C", path)
    spec = importlib.util.spec_from_file_location("verl._C", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules["verl._C"] = mod
    return mod


_errors: list[BaseException] = []


def load_error() -> BaseException | None:
    load()
    return _errors[0] if _errors else None


def available() -> bool:
    return load() is not None


def built_with_cuda() -> bool:
    mod = load()
    return bool(mod is not None and getattr(mod, "with_cuda", 0))


def cuda_archs() -> list[str]:
    mod = load()
    archs = getattr(mod, "cuda_archs", "") if mod is not None else ""
    return [a for a in archs.split(";") if a]


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether `verl::op` has a kernel for `dispatch_key` ("CPU", "CUDA"): its own, or a
    CompositeExplicitAutograd one (device-generic ATen code, e.g. loss_grad_scale), which serves every device."""
    if not available():
        return False
    name = f"verl::{op}"
    return (torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
            or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"))


def op_names() -> list[str]:
    """Every op declared in the TORCH_LIBRARY(verl) block."""
    if not available():
        return []
    return sorted(str(s.name).split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
                  if str(s.name).startswith("verl::"))


_warned: set[str] = set()


def warn_fallback(what: str) -> None:
    """Warns once per reason that verl.ops runs its pure-PyTorch reference instead of a fused kernel."""
    if what in _warned:
        return
    _warned.add(what)
    err = load_error()
    detail = f" ({type(err).__name__}: {err})" if err is not None else ""
    warnings.warn(f"verl.ops: {what}{detail}; using the pure-PyTorch reference implementations. To get the fused "
                  f"kernels, {BUILD_HINT}.", RuntimeWarning, stacklevel=3)


def register_python_parts(fakes: dict, autograd: dict) -> None:
    """Registers the Python halves of `verl::` ops (the kernel pattern): `fakes` maps an op name to its fake
    (meta) implementation, `autograd` maps it to (backward, setup_context). Called once per ops module, only when
    the extension imported (the ops do not exist otherwise)."""
    import torch
    for op, fake in fakes.items():
        torch.library.register_fake("verl::" + op, fake)
    for op, (backward, setup) in autograd.items():
        torch.library.register_autograd("verl::" + op, backward, setup_context=setup)
