"""`verl train` and `python -m verl.trainer.main_ppo` print verl's own errors as one short message naming the key
and the fix, with no traceback (VERL_TRACEBACK=1 brings it back), and exit non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str, traceback: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env.pop("VERL_TRACEBACK", None)
    if traceback:
        env["VERL_TRACEBACK"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.parametrize("module,args", [("verl.cli.main", ("train",)), ("verl.trainer.main_ppo", ())])
@pytest.mark.parametrize("override,key", [("actor.optim.lr=inf", "actor.optim.lr"), ("algorithm=grpo", "algorithm"),
                                          ("actor.optim.learnig_rate=1", "actor.optim.learnig_rate")])
def test_clear_config_error_is_one_short_message(module, args, override, key):
    out = _run(module, *args, override)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "config error" in line]
    assert len(lines) == 1 and key in lines[0], out.stderr
    assert "VERL_TRACEBACK=1" in out.stderr


def test_behaves_traceback_on_request():
    out = _run("verl.cli.main", "train", "actor.optim.lr=inf", traceback=True)
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "ConfigValueError" in out.stderr and "actor.optim.lr" in out.stderr


def test_clear_missing_config_file_names_it(tmp_path):
    out = _run("verl.cli.main", "train", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "nope.yaml" in out.stderr and "Traceback" not in out.stderr


def test_clear_runtime_error_shows_its_cause(capsys):
    from verl.errors import VerlRuntimeError, run_cli

    def main(argv):
        try:
            1 / 0
        except ZeroDivisionError as e:
            raise VerlRuntimeError("advantage failed", node="advantage", rank=0, cause=e) from e

    assert run_cli(main, [], prog="verl train") == 1
    err = capsys.readouterr().err
    assert "[node 'advantage', rank 0] advantage failed" in err and "caused by ZeroDivisionError" in err
