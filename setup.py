"""Builds verl and its extension `verl._C` (csrc/) with torch.utils.cpp_extension and ninja.

C++ CPU kernels are always built. CUDA kernels (csrc/**/*.cu) are built too when nvcc and a CUDA build of
torch are present; `VERL_BUILD_CUDA=0|1` forces the choice. `TORCH_CUDA_ARCH_LIST` defaults to "8.0;9.0".
`VERL_SKIP_EXT=1` installs the pure-Python package only (verl.ops then falls back to its references).

Install for development (torch must already be installed; build isolation would pull another torch):
    pip install --no-build-isolation -e .
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
KNOWN_ARCHS = {"5.0", "5.2", "6.0", "6.1", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "9.0a",
               "10.0", "10.0a", "10.3", "11.0", "12.0", "12.0a"}


class BuildError(SystemExit):
    def __init__(self, msg: str):
        super().__init__(f"\n[verl setup] error: {msg}\n")


def _env_flag(name: str) -> bool | None:
    val = os.environ.get(name)
    if val is None or val == "":
        return None
    if val.lower() in ("1", "true", "yes", "on"):
        return True
    if val.lower() in ("0", "false", "no", "off"):
        return False
    raise BuildError(f"{name}={val!r} is not understood; use {name}=1 or {name}=0")


def _find_cuda_home() -> str | None:
    """CUDA_HOME from the environment, else the real toolkit folder behind `nvcc`.

    torch guesses the folder above the first `nvcc` on PATH; when that is a wrapper script (as in
    /usr/local/bin/nvcc) the guess is wrong and the link fails with `cannot find -lcudart`.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    real = os.path.realpath(nvcc)
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):  # a wrapper script: follow its `exec /path/bin/nvcc`
            m = re.search(rb"(/\S+)/bin/nvcc", head)
            if m:
                return m.group(1).decode()
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _check_arch_list() -> str:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0"
    entries = [a.strip() for a in re.split(r"[;\s,]+", archs) if a.strip()]
    for a in entries:
        base = a.replace("+PTX", "")
        if base not in KNOWN_ARCHS:
            raise BuildError(
                f"TORCH_CUDA_ARCH_LIST entry {a!r} is not a CUDA architecture this build knows. "
                f"Use entries like 8.0 (A100), 9.0 (H100/H200), optionally with +PTX; known: "
                f"{', '.join(sorted(KNOWN_ARCHS, key=lambda s: float(s.rstrip('a'))))}")
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(entries)
    return ";".join(entries)


def _ext_modules():
    if _env_flag("VERL_SKIP_EXT"):
        return [], {}
    try:
        import torch
    except ImportError:
        raise BuildError("torch is not installed. Install it first (CPU: `pip install torch==2.13.0`; CUDA: "
                         "`pip install torch==2.14.1`), then build with `pip install --no-build-isolation -e .`")
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        raise BuildError("no C++ compiler found (c++ / g++). Install one: `apt-get install g++` (Debian/Ubuntu).")
    if shutil.which("ninja") is None:
        raise BuildError("ninja is not installed; the extension is built with ninja. `pip install ninja`.")

    want_cuda = _env_flag("VERL_BUILD_CUDA")
    cuda_home = _find_cuda_home()
    torch_cuda = torch.version.cuda
    can_cuda = cuda_home is not None and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) and torch_cuda
    if want_cuda and not can_cuda:
        why = ("torch is a CPU build (torch.version.cuda is None); install a CUDA build, e.g. `pip install torch==2.14.1`"
               if not torch_cuda else "nvcc was not found; install the CUDA toolkit and set CUDA_HOME to its folder")
        raise BuildError(f"VERL_BUILD_CUDA=1 but CUDA kernels cannot be built: {why}.")
    build_cuda = bool(can_cuda) if want_cuda is None else want_cuda

    archs = ""
    if build_cuda:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
        nvcc_ver = _nvcc_version(cuda_home)
        if nvcc_ver is None:
            raise BuildError(f"could not run {cuda_home}/bin/nvcc --version; set CUDA_HOME to a working toolkit.")
        if nvcc_ver.split(".")[0] != torch_cuda.split(".")[0]:
            raise BuildError(
                f"CUDA toolkit {nvcc_ver} (nvcc in {cuda_home}) does not match torch's CUDA {torch_cuda}: the major "
                f"versions must agree. Install the CUDA {torch_cuda.split('.')[0]}.x toolkit and set CUDA_HOME, or a "
                f"torch built for CUDA {nvcc_ver.split('.')[0]}, or build CPU-only with VERL_BUILD_CUDA=0.")
        archs = _check_arch_list()

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    # No -std= flag of our own: torch 2.14 needs C++20 and adds it only when none is given.
    cxx_flags = ["-O3", f"-DVERL_WITH_CUDA={int(build_cuda)}", f'-DVERL_CUDA_ARCHS="{archs}"']
    if sys.platform.startswith("linux"):
        cxx_flags += ["-fopenmp"]
    extra = {"cxx": cxx_flags}
    if build_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        # The torch wheel ships the CUDA library headers (cusparse.h, ...) in nvidia/cu13/include; the
        # toolkit folder may hold only nvcc and cudart, and ATen/cuda/CUDAContext.h needs them.
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                include_dirs += sorted(glob.glob(os.path.join(loc, "cu*", "include")))
                include_dirs += sorted(glob.glob(os.path.join(loc, "*", "include")))
        extra["nvcc"] = ["-O3", "-lineinfo", f"-DVERL_WITH_CUDA=1", f'-DVERL_CUDA_ARCHS="{archs}"',
                         "--expt-relaxed-constexpr"]
        ext = CUDAExtension("verl._C", sources, include_dirs=include_dirs, extra_compile_args=extra,
                            extra_link_args=["-fopenmp"])
    else:
        ext = CppExtension("verl._C", sources, include_dirs=include_dirs, extra_compile_args=extra,
                           extra_link_args=["-fopenmp"])
    print(f"[verl setup] building verl._C: CPU{' + CUDA (' + archs + ')' if build_cuda else ''}", flush=True)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules()

setup(
    packages=find_packages(include=["verl", "verl.*", "megatron_patches", "megatron_patches.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
