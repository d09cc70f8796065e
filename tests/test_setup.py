"""setup.py's bad-input messages: they say what to install or set, not a compiler dump."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(env_extra: dict[str, str], path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _linked_bin(tmp_path, names):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in names:
        target = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        if target:
            os.symlink(target, folder / name)
    return str(folder)


def test_missing_compiler_is_explained(tmp_path):
    proc = _setup({"VERL_BUILD_CUDA": "0", "CXX": "c++"}, path=_linked_bin(tmp_path, ["ninja"]))
    assert proc.returncode != 0
    assert "no C++ compiler found" in proc.stderr + proc.stdout


def test_missing_ninja_is_explained(tmp_path):
    proc = _setup({"VERL_BUILD_CUDA": "0"}, path=_linked_bin(tmp_path, ["c++", "g++"]))
    assert proc.returncode != 0
    assert "ninja is not installed" in proc.stderr + proc.stdout and "pip install ninja" in proc.stderr + proc.stdout


def test_bad_flag_value_is_explained():
    proc = _setup({"VERL_BUILD_CUDA": "maybe"})
    assert proc.returncode != 0 and "VERL_BUILD_CUDA='maybe' is not understood" in proc.stderr + proc.stdout


@pytest.mark.cpu_torch
@pytest.mark.skipif(__import__("torch").version.cuda is not None, reason="checks the CPU-torch message")
def test_forcing_cuda_with_cpu_torch_is_explained():
    proc = _setup({"VERL_BUILD_CUDA": "1"})
    assert proc.returncode != 0
    assert "torch is a CPU build" in proc.stderr + proc.stdout and "torch==2.14.1" in proc.stderr + proc.stdout


@pytest.mark.cuda_torch
@pytest.mark.skipif(__import__("torch").version.cuda is None, reason="needs a CUDA build of torch (CI's CUDA env)")
def test_unknown_arch_is_explained():
    proc = _setup({"VERL_BUILD_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "8.0;7.7"})
    assert proc.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST entry '7.7'" in proc.stderr + proc.stdout


@pytest.mark.cuda_torch
@pytest.mark.skipif(__import__("torch").version.cuda is None, reason="needs a CUDA build of torch (CI's CUDA env)")
def test_cuda_major_mismatch_is_explained(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    nvcc.chmod(0o755)
    proc = _setup({"VERL_BUILD_CUDA": "1", "CUDA_HOME": str(home)})
    assert proc.returncode != 0 and "does not match torch's CUDA" in proc.stderr + proc.stdout
