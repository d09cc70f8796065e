"""The test suite's strict mode (tests/conftest.py, VERL_TEST_ENV), the one CI runs in: a broken verl._C or vLLM
import fails the run naming the import error, a skip for anything but absent hardware fails, and the skip
reasons are printed with their counts at the end. Each case runs pytest in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("PYTEST_ADDOPTS", None)
    full.pop("VERL_SKIP_SUMMARY", None)  # CI's summary file is for its own runs, not these samples
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=600)


def test_extension_path_names_a_missing_library():
    from verl import _extension
    with pytest.raises(ImportError, match="VERL_EXTENSION_PATH='/nonexistent/_C.so': no such file"):
        _extension._load_file("/nonexistent/_C.so")


def test_a_broken_extension_fails_the_run_naming_the_import_error(tmp_path):
    """verl._C built but not importable (here: a file that is no shared library)."""
    lib = tmp_path / "_C.so"
    lib.write_bytes(b"not a shared library")
    p = _pytest(["tests/ops/test_masked.py"], ROOT, VERL_TEST_ENV="dev", VERL_EXTENSION_PATH=str(lib))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "strict mode (VERL_TEST_ENV=dev): the dev environment is missing what it is meant to have" in out, out
    assert f"verl._C: ImportError: {lib}: file too short" in out, out
    # outside strict mode the same run skips those tests, each naming the import error, and passes
    p = _pytest(["tests/ops/test_masked.py::test_gradcheck"], ROOT, VERL_TEST_ENV="", VERL_EXTENSION_PATH=str(lib))
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "skipped: verl._C does not import (ImportError" in out, out


def test_a_broken_vllm_import_fails_the_vllm_check(tmp_path):
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    p = _pytest(["tests/rollout/test_vllm_engine.py"], ROOT, VERL_TEST_ENV="vllm",
                PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "vllm: ImportError: libcudart.so.13: cannot open shared object file" in out, out


SAMPLE = '''
import pytest
from tests.conftest import hardware_skip

def test_runs():
    assert True

def test_needs_a_module():
    pytest.importorskip("verl_no_such_module")

@hardware_skip("no CUDA GPU")
def test_on_a_gpu():
    pass
'''


@pytest.mark.parametrize("strict", [True, False])
def test_only_absent_hardware_may_skip(tmp_path, strict):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    p = _pytest(["-p", "tests.conftest", "test_sample.py"], tmp_path, VERL_TEST_ENV="dev" if strict else "")
    out = p.stdout + p.stderr
    summary = out[out.index("skip summary"):]
    if strict:
        assert p.returncode == 1, out
        assert ("strict mode (VERL_TEST_ENV=dev): this skipped, and only absent hardware may skip a test here. "
                "Its reason: could not import 'verl_no_such_module'") in out, out
        assert "1 failed, 1 passed, 1 skipped" in out, out
        assert "    1 skipped: hardware: no CUDA GPU" in summary, summary
    else:
        assert p.returncode == 0, out
        assert "    1 skipped: could not import 'verl_no_such_module'" in summary, summary
        assert "    1 skipped: hardware: no CUDA GPU" in summary, summary
