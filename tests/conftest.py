"""Suite-wide settings: CUDA tests skip cleanly without a GPU; ops tests run on one thread for stability."""

from __future__ import annotations

import pytest
import torch


def cuda_ready() -> bool:
    from verl import _extension
    return torch.cuda.is_available() and _extension.built_with_cuda()


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    why = ("no CUDA GPU" if not torch.cuda.is_available() else "verl._C was built without CUDA kernels")
    skip = pytest.mark.skip(reason=f"CUDA test skipped: {why}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def devices() -> list:
    """Parametrisation helper: CPU always, CUDA as a marked (skippable) case."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
