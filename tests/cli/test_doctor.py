"""`verl doctor` and the `verl` command line."""

from __future__ import annotations

import importlib
import json

import pytest

from verl.cli import doctor
from verl.cli.main import main as verl_main


def _by_name(findings):
    return {f.name: f for f in findings}


def test_doctor_reports_every_piece(capsys):
    rc = verl_main(["doctor"])
    out = capsys.readouterr().out
    for piece in ["torch", "nvcc", "verl._C", "megatron-core", "transformers", "tensordict", "flash-attn",
                  "Transformer Engine", "NVIDIA apex"]:
        assert piece in out, f"doctor does not report {piece}"
    from verl.engines import KINDS, engines
    for kind in KINDS:  # every engine of the engine table, usable or with the reason it is not
        for name in engines(kind):
            assert f"{kind} engine {name}" in out
    assert "PyPI package `apex` is NOT NVIDIA apex" in out or "NVIDIA apex" in out
    assert rc in (0, 1)


def test_doctor_json_is_machine_readable(capsys):
    verl_main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    names = {d["name"] for d in data}
    assert {"torch", "verl._C", "megatron-core"} <= names
    assert all(d["status"] in ("ok", "warn", "FAIL", "info") for d in data)


def test_extension_backends_are_reported():
    from verl import _extension
    f = _by_name(doctor.run_checks())["verl._C"]
    if _extension.available():
        assert f.status == "ok" and "built for CPU" in f.detail
    else:
        assert f.status == "warn" and "pip install --no-build-isolation -e ." in f.fix


def test_pypi_apex_impostor_is_detected(tmp_path, monkeypatch):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("# the unrelated PyPI `apex`\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    f = doctor.check_apex()
    assert f.status == "FAIL" and "NOT NVIDIA apex" in f.detail and "pip uninstall -y apex" in f.fix


def test_real_nvidia_apex_layout_is_accepted(tmp_path, monkeypatch):
    (tmp_path / "apex" / "normalization").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "normalization" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert doctor.check_apex().status == "ok"


def test_half_installed_transformer_engine_is_detected(tmp_path, monkeypatch):
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    f = doctor.check_transformer_engine()
    assert f.status == "FAIL" and "half-installed" in f.detail and "transformer_engine_torch" in f.detail


def test_nvcc_major_mismatch_is_a_failure(monkeypatch, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    nvcc = fake / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))

    class FakeTorch:
        class version:
            cuda = "13.0"

    f = doctor.check_nvcc(FakeTorch)[0]
    assert f.status == "FAIL" and "11.8" in f.detail and "CUDA 13.x toolkit" in f.fix


def test_unknown_command_suggests(capsys):
    assert verl_main(["docter"]) == 2
    assert "did you mean 'doctor'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_help(argv, capsys):
    assert verl_main(argv) == 0
    assert "verl doctor" in capsys.readouterr().out
