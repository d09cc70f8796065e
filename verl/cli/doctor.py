"""`verl doctor`: checks the stack verl runs on and says what to install for every missing or broken piece.

Installing the GPU stack is the first thing users trip over, so each finding carries one line of advice.
The checks avoid importing heavy or fragile packages in this process (a half-installed Transformer Engine
crashes `import megatron.core`); they read package metadata and, where an import must be tried, do it in a
subprocess with a timeout.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"


@dataclasses.dataclass(kw_only=True, slots=True)
class Finding:
    """One line of the report."""

    name: str
    """What was checked (a package or a piece of the toolchain)."""
    status: str
    """ok / warn / FAIL / info."""
    detail: str
    """What was found."""
    fix: str = ""
    """What to install or set, when something is missing or broken."""


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _try_import(module: str, timeout: float = 60.0) -> tuple[bool, str]:
    """Imports `module` in a fresh interpreter; returns (ok, last line of the error)."""
    try:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"`import {module}` took longer than {timeout:.0f}s"
    if proc.returncode == 0:
        return True, ""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"exit code {proc.returncode}"


def check_torch() -> tuple[list[Finding], object | None]:
    try:
        import torch
    except ImportError:
        return [Finding(name="torch", status=FAIL, detail="not installed",
                        fix="pip install torch==2.13.0 (CPU) or torch==2.14.1 (CUDA 13)")], None
    cuda = torch.version.cuda
    usable = torch.cuda.is_available()
    if cuda is None:
        detail, status = f"{torch.__version__} (CPU build)", OK
        fix = "for GPUs: pip install torch==2.14.1 (CUDA 13 build)"
    elif usable:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        detail, status, fix = f"{torch.__version__} (CUDA {cuda}; {torch.cuda.device_count()} GPU(s): {names})", OK, ""
    else:
        detail, status = f"{torch.__version__} (CUDA {cuda} build, but no usable GPU/driver)", WARN
        fix = "no GPU visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES; CPU runs still work"
    return [Finding(name="torch", status=status, detail=detail, fix=fix)], torch


def _find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def check_nvcc(torch_mod) -> list[Finding]:
    nvcc = _find_nvcc()
    if nvcc is None:
        return [Finding(name="nvcc", status=INFO, detail="not found (needed only to build the CUDA kernels)",
                        fix="install the CUDA toolkit matching torch.version.cuda and set CUDA_HOME")]
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [Finding(name="nvcc", status=WARN, detail=f"{nvcc} does not run: {e}", fix="reinstall the CUDA toolkit")]
    m = re.search(r"release (\d+\.\d+)", out)
    ver = m.group(1) if m else "unknown"
    torch_cuda = getattr(getattr(torch_mod, "version", None), "cuda", None) if torch_mod else None
    if torch_cuda is None:
        return [Finding(name="nvcc", status=INFO, detail=f"{ver} at {nvcc}; torch is a CPU build, so CUDA kernels "
                        "are not built", fix="for CUDA kernels: pip install torch==2.14.1 (CUDA 13), then rebuild")]
    if ver.split(".")[0] != torch_cuda.split(".")[0]:
        return [Finding(name="nvcc", status=FAIL, detail=f"{ver} at {nvcc}, but torch was built with CUDA {torch_cuda}",
                        fix=f"install a CUDA {torch_cuda.split('.')[0]}.x toolkit and set CUDA_HOME to it")]
    return [Finding(name="nvcc", status=OK, detail=f"{ver} at {nvcc} (matches torch's CUDA {torch_cuda})")]


def check_extension(torch_mod) -> list[Finding]:
    if torch_mod is None:
        return []
    from verl import _extension
    hint = "pip install --no-build-isolation -e . (or bash scripts/setup_env.sh dev)"
    if not _extension.available():
        err = _extension.load_error()
        return [Finding(name="verl._C", status=WARN,
                        detail=f"not built or not importable ({type(err).__name__}: {err}); verl.ops uses the "
                               "pure-PyTorch references", fix=hint)]
    ops = _extension.op_names()
    cpu = [o for o in ops if _extension.has_kernel(o, "CPU")]
    cuda = [o for o in ops if _extension.has_kernel(o, "CUDA")]
    backends = "CPU" + (f" + CUDA (archs {', '.join(_extension.cuda_archs())})" if _extension.built_with_cuda() else "")
    detail = f"built for {backends}; {len(ops)} ops, {len(cpu)} with CPU kernels, {len(cuda)} with CUDA kernels"
    findings = [Finding(name="verl._C", status=OK, detail=detail)]
    missing_cpu = sorted(set(ops) - set(cpu))
    if missing_cpu:
        findings.append(Finding(name="verl._C CPU kernels", status=FAIL, detail=f"missing for {missing_cpu}",
                                fix="rebuild: " + hint))
    if _extension.built_with_cuda() and set(ops) - set(cuda):
        findings.append(Finding(name="verl._C CUDA kernels", status=FAIL,
                                detail=f"missing for {sorted(set(ops) - set(cuda))}",
                                fix="rebuild with VERL_BUILD_CUDA=1"))
    if not _extension.built_with_cuda() and torch_mod.cuda.is_available():
        findings.append(Finding(name="verl._C CUDA kernels", status=WARN, detail="a GPU is visible but verl._C has no "
                                "CUDA kernels", fix="rebuild with nvcc on PATH: VERL_BUILD_CUDA=1 " + hint))
    return findings


def check_transformer_engine() -> Finding:
    te = _version("transformer_engine") or _version("transformer-engine")
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None and te is None:
        return Finding(name="Transformer Engine", status=INFO, detail="not installed (optional, GPU only)",
                       fix="GPU clusters: pip install 'verl[gpu]' (transformer-engine[pytorch])")
    # Half-installed TE (the python package without its torch library) crashes `import megatron.core`.
    torch_lib = (importlib.util.find_spec("transformer_engine_torch") is not None
                 or _version("transformer_engine_torch") is not None)
    if not torch_lib:
        return Finding(name="Transformer Engine", status=FAIL,
                       detail=f"{te or 'present'} but half-installed: its torch library (transformer_engine_torch) "
                              "is missing, which crashes `import megatron.core`",
                       fix="pip uninstall -y transformer-engine transformer-engine-cu12 transformer-engine-cu13; then "
                           "(GPU only) pip install --no-build-isolation 'transformer-engine[pytorch]'")
    ok, err = _try_import("transformer_engine.pytorch")
    if not ok:
        return Finding(name="Transformer Engine", status=WARN, detail=f"{te}: import fails ({err})",
                       fix="reinstall transformer-engine[pytorch] matching your torch and CUDA")
    return Finding(name="Transformer Engine", status=OK, detail=str(te))


def check_apex() -> Finding:
    spec = importlib.util.find_spec("apex")
    if spec is None:
        return Finding(name="NVIDIA apex", status=INFO, detail="not installed (optional, GPU only; fused optimizers)",
                       fix="build from source: github.com/NVIDIA/apex (the PyPI package `apex` is NOT NVIDIA apex)")
    # Look at the files rather than importing: NVIDIA apex has apex/normalization and apex/optimizers.
    locations = list(spec.submodule_search_locations or [])
    nvidia = any(os.path.isdir(os.path.join(loc, sub)) for loc in locations for sub in ("normalization", "optimizers"))
    if not nvidia:
        return Finding(name="NVIDIA apex", status=FAIL,
                       detail=f"the installed `apex` ({_version('apex') or '?'}) is the unrelated PyPI package, NOT "
                              "NVIDIA apex",
                       fix="pip uninstall -y apex; NVIDIA apex is built from source (github.com/NVIDIA/apex)")
    return Finding(name="NVIDIA apex", status=OK, detail=_version("apex") or "present")


def check_packages() -> list[Finding]:
    out = []
    required = [("megatron-core", "megatron.core", "pip install megatron-core==0.16.1"),
                ("transformers", "transformers", "pip install transformers"),
                ("tensordict", "tensordict", "pip install tensordict")]
    for dist, module, fix in required:
        ver = _version(dist)
        if ver is None or importlib.util.find_spec(module.split(".")[0]) is None:
            out.append(Finding(name=dist, status=FAIL, detail="not installed", fix=fix))
        else:
            out.append(Finding(name=dist, status=OK, detail=ver))
    out += check_engines()
    fa = _version("flash-attn") or _version("flash_attn")
    out.append(Finding(name="flash-attn", status=OK, detail=fa) if fa else
               Finding(name="flash-attn", status=INFO, detail="not installed (optional, GPU only)",
                       fix="GPU: pip install flash-attn --no-build-isolation"))
    out.append(check_transformer_engine())
    out.append(check_apex())
    return out


def check_engines() -> list[Finding]:
    """One line per engine of the engine table (`verl.engines`): usable here, or why not and how to install."""
    from verl.engines import KINDS, engine_spec, engines
    out = []
    for kind in KINDS:
        for name in engines(kind):
            spec = engine_spec(kind, name)
            try:
                ok, why = spec.check_available()
            except Exception as e:  # noqa: BLE001 - a broken check is itself a finding
                ok, why = False, f"its availability check failed: {type(e).__name__}: {e}"
            version = next((v for v in map(_version, spec.packages) if v), None)
            detail = f"{spec.summary}{f' ({version})' if version else ''}"
            out.append(Finding(name=f"{kind} engine {name}", status=OK if ok else INFO,
                               detail=detail if ok else f"not usable here: {why}", fix=spec.install))
    return out


def run_checks() -> list[Finding]:
    findings = [Finding(name="python", status=OK if sys.version_info >= (3, 11) else FAIL,
                        detail=sys.version.split()[0], fix="" if sys.version_info >= (3, 11) else "use Python >= 3.11")]
    torch_findings, torch_mod = check_torch()
    findings += torch_findings
    findings += check_nvcc(torch_mod)
    findings += check_extension(torch_mod)
    findings += check_packages()
    return findings


def render(findings: list[Finding]) -> str:
    width = max(len(f.name) for f in findings)
    lines = ["verl doctor"]
    for f in findings:
        lines.append(f"  [{f.status:>4}] {f.name:<{width}}  {f.detail}")
        if f.fix and f.status != OK:
            lines.append(f"  {'':6} {'':<{width}}  -> {f.fix}")
    n_fail = sum(f.status == FAIL for f in findings)
    n_warn = sum(f.status == WARN for f in findings)
    lines.append(f"{n_fail} problem(s), {n_warn} warning(s)" if n_fail or n_warn else "everything needed is in place")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="verl doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    findings = run_checks()
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        print(render(findings))
    return 1 if any(f.status == FAIL for f in findings) else 0
