"""megatron_patches: the single, version-guarded place where verl changes megatron-core.

    import megatron_patches
    megatron_patches.apply()          # before building megatron models; safe to call any number of times

What it does: makes megatron-core 0.16.1 run on a CPU-only machine with the gloo backend (model build,
forward/backward with TP/SP/PP, pipeline schedules, DDP + distributed optimizer, grad clipping), so that the
whole Megatron path of verl is testable without GPUs. `megatron_patches.PATCHES` lists each patch with why it
exists, what it touches, its mechanism and the versions it was verified on; `describe()` prints that table.

Rules:
- a no-op when CUDA is available (nothing is needed there) — `apply()` returns an empty tuple;
- idempotent: a second call changes nothing;
- refuses (with an explanation) a megatron-core or torch version the patches were not verified on, unless
  the caller passes ``force=True`` or sets ``VERL_MEGATRON_PATCHES=force``;
- ``VERL_MEGATRON_PATCHES=off`` disables them (then megatron on CPU fails where the patches say it would);
- narrowest mechanism first: replace one function > recompile one function with an exact, counted text
  replacement > a CPU view of `torch` bound inside one listed megatron module (never a global torch patch,
  never a TorchFunctionMode).
"""

from __future__ import annotations

import os
import threading

import torch

from megatron_patches._patches import PATCHES, VERIFIED_MEGATRON, VERIFIED_TORCH, Patch

__all__ = ["PATCHES", "Patch", "MegatronPatchError", "apply", "applied", "describe", "revert",
           "VERIFIED_MEGATRON", "VERIFIED_TORCH"]

_LOCK = threading.Lock()
_APPLIED: list[str] = []


class MegatronPatchError(RuntimeError):
    """The installed megatron-core/torch is not one the patches were verified on, or a patch target changed."""


def _megatron_version() -> str:
    from megatron.core import package_info
    return package_info.__version__


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _check_versions(patches: tuple[Patch, ...]) -> None:
    mc, tv = _megatron_version(), _torch_minor()
    bad = [p.name for p in patches if mc not in p.megatron_versions or tv not in p.torch_versions]
    if bad:
        raise MegatronPatchError(
            f"megatron_patches were verified on megatron-core {', '.join(VERIFIED_MEGATRON)} with torch "
            f"{', '.join(VERIFIED_TORCH)}.x, but this environment has megatron-core {mc} and torch "
            f"{torch.__version__}. "
            f"Patches {bad} replace megatron-core internals that may have moved, so they are not applied. "
            f"Fix: pip install megatron-core=={VERIFIED_MEGATRON[-1]}, "
            f"or run on a CUDA machine (no patch is needed there), or pass force=True / set "
            f"VERL_MEGATRON_PATCHES=force to try them anyway (each still refuses if its exact target text is missing).")


def apply(*, force: bool | None = None, exclude: tuple[str, ...] | frozenset[str] = ()) -> tuple[str, ...]:
    """Applies every patch not yet applied; returns the names applied by this process so far.

    `exclude` names patches to leave out (tests use it to show each patch is needed).
    """
    mode = os.environ.get("VERL_MEGATRON_PATCHES", "on").lower()
    if mode not in ("on", "off", "force"):
        raise MegatronPatchError(f"VERL_MEGATRON_PATCHES={mode!r} is not one of on / off / force")
    if mode == "off" or torch.cuda.is_available():
        return tuple(_APPLIED)
    unknown = set(exclude) - {p.name for p in PATCHES}
    if unknown:
        raise MegatronPatchError(f"exclude names unknown patches {sorted(unknown)}; known: {[p.name for p in PATCHES]}")
    force = (mode == "force") if force is None else force
    with _LOCK:
        todo = tuple(p for p in PATCHES if p.name not in _APPLIED and p.name not in exclude)
        if not todo:
            return tuple(_APPLIED)
        if not force:
            _check_versions(todo)
        for patch in todo:
            try:
                patch.install()
            except Exception as e:
                raise MegatronPatchError(f"patch {patch.name!r} could not be applied to megatron-core "
                                         f"{_megatron_version()}: {e}") from e
            _APPLIED.append(patch.name)
    return tuple(_APPLIED)


def applied() -> tuple[str, ...]:
    """Names of the patches applied in this process."""
    return tuple(_APPLIED)


def revert() -> None:
    """Restores megatron-core exactly as it was (every replaced attribute put back)."""
    from megatron_patches import _mechanisms
    with _LOCK:
        _mechanisms.revert_all()
        _APPLIED.clear()


def describe() -> str:
    """A table of the patches: name, mechanism, versions, why."""
    rows = [f"{p.name:<30} {p.mechanism:<20} megatron-core {'/'.join(p.megatron_versions)}, "
            f"torch {'/'.join(p.torch_versions)}\n    why: {p.why}" for p in PATCHES]
    return "\n".join(rows)
