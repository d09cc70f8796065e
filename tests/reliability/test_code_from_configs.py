"""Code named in a config (``reward.name=module:fn``, a dataflow node reference) comes from one search path, whatever
the entry point: PYTHONPATH and the installed packages, the current directory only when PYTHONPATH names it; the
log says where each reference was loaded from (issue #32, item 6).

The hostile module of each case writes a marker file when imported: a refusal must leave no marker (its code
never ran).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl import registry
from verl.errors import VerlConfigError
from verl.registry import import_ref

REPO = Path(__file__).resolve().parents[2]
MARKER = "imported.marker"


@pytest.fixture
def cwd_with_code(tmp_path, monkeypatch):
    """A working directory holding user code (modules, a package, a namespace package), with PYTHONPATH naming
    only the checkout (so the current directory is not asked for); sys.path as `python -m` makes it."""
    body = f"open({str(tmp_path / MARKER)!r}, 'w').write('ran')\n\ndef fn(response, ground_truth, prompt):\n" \
           f"    return 1.0\n"
    (tmp_path / "evil_reward.py").write_text(body)
    (tmp_path / "evil_pkg").mkdir()
    (tmp_path / "evil_pkg" / "__init__.py").write_text("")
    (tmp_path / "evil_pkg" / "mod.py").write_text(body)
    (tmp_path / "evil_ns").mkdir()
    (tmp_path / "evil_ns" / "mod.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.syspath_prepend(str(tmp_path))  # python -m puts the current directory first
    yield tmp_path
    for name in ("evil_reward", "evil_pkg", "evil_pkg.mod", "evil_ns", "evil_ns.mod"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("ref", ["evil_reward:fn", "evil_pkg.mod:fn", "evil_ns.mod:fn"])
def test_clear_code_from_the_current_directory_is_refused(cwd_with_code, ref):
    module = ref.split(":")[0]
    with pytest.raises(VerlConfigError, match=rf"reward.name='{ref}': module '{module}' is in the "
                                              rf"current directory .*PYTHONPATH=\."):
        import_ref(ref, "reward", "reward.name")
    assert not (cwd_with_code / MARKER).exists(), "the refused module's code ran"


def test_behaves_current_directory_allowed_when_pythonpath_names_it(cwd_with_code, monkeypatch, capsys):
    monkeypatch.setattr(registry, "_LOGGED", set())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), "."]))
    fn = import_ref("evil_pkg.mod:fn", "reward", "reward.name")
    assert fn("a", "b", "c") == 1.0 and (cwd_with_code / MARKER).exists()
    assert f"verl: reward.name='evil_pkg.mod:fn' loaded from {cwd_with_code / 'evil_pkg' / 'mod.py'}" in \
        capsys.readouterr().out


def test_clear_dataflow_node_reference_follows_the_same_rule(cwd_with_code):
    from verl.dataflow import get_node
    with pytest.raises(VerlConfigError, match=r"node reference 'evil_reward:fn': module 'evil_reward' is in the "
                                              r"current directory"):
        get_node("evil_reward:fn")
    assert not (cwd_with_code / MARKER).exists()


def test_behaves_installed_and_pythonpath_code_loads_and_says_where(capsys, monkeypatch):
    monkeypatch.setattr(registry, "_LOGGED", set())  # said once per process: another test may have said it
    fn = import_ref("tests.trainer.test_multiprocess:length_reward", "reward", "reward.name")  # via PYTHONPATH
    assert fn("abc", "", "") == 3.0
    assert import_ref("json:dumps") is __import__("json").dumps  # the standard library
    out = capsys.readouterr().out
    assert f"loaded from {REPO / 'tests' / 'trainer' / 'test_multiprocess.py'}" in out


@pytest.mark.parametrize("entry", [["-m", "verl.trainer.main_ppo"], ["-m", "verl.cli.main", "train"],
                                   [str(Path(sys.executable).parent / "verl"), "train"]],
                         ids=["python -m verl.trainer.main_ppo", "python -m verl.cli.main train", "verl train"])
def test_clear_both_entry_points_refuse_the_same_way(tmp_path, entry):
    """The audit's case: `python -m verl.trainer.main_ppo reward.name=evil_reward:fn` imported evil_reward.py from
    the current directory, while `verl train` refused it."""
    (tmp_path / "evil_reward.py").write_text(f"open({str(tmp_path / MARKER)!r}, 'w').write('ran')\n"
                                             f"def fn(response, ground_truth, prompt):\n    return 1.0\n")
    args = ["reward.name=evil_reward:fn", "trainer.device=cpu", "warmup.steps=0", "trainer.total_steps=1",
            f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress_bar=false"]
    proc = subprocess.run([sys.executable, *entry, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"config error: reward.name.{0,3}'evil_reward:fn': module 'evil_reward' is in the current "
                     r"directory \(" + re.escape(str(tmp_path / "evil_reward.py")) + r"\), which is not on verl's "
                     r"search path", proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / MARKER).exists()
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused before any work
