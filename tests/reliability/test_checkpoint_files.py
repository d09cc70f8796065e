"""Bad checkpoint and run-folder files, each met with a clear error that names the file (`test_clear_*`) or with
correct behaviour and nothing lost (`test_behaves_*`): truncated, flipped, empty, stale, manifest-less, crafted
(a pickle whose unpickling would run code: refused, and the code never runs), from another run; torn and
duplicated metrics; a fresh run in a used folder; replacing a step; and SIGKILL at random moments of a save.

Count the cases by category:  pytest --collect-only -q tests/reliability/test_checkpoint_files.py | grep -c clear
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.models.optimizer import read_plain_state
from verl.utils import checkpoint as ckpt_mod
from verl.utils.checkpoint import MANIFEST, CheckpointManager, read_manifest, verify
from verl.utils.metrics import MetricsLogger, metrics_view, read_metrics
from verl.utils.run_folder import RunFolder

from tests.reliability._save_loop import build

REPO = Path(__file__).resolve().parents[2]


# -- helpers --------------------------------------------------------------------------------------------------
def _model(value: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A linear layer with optimizer state, all weights equal to `value` (so a load is checkable)."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, opt


def _save(root: Path, *steps: int, keep: int = 0, mgr: CheckpointManager | None = None) -> CheckpointManager:
    mgr = mgr or CheckpointManager(root, Placement(), keep=keep)
    for s in steps:
        model, opt = _model(float(s))
        mgr.save(s, {"m": (model, opt)}, {}, {"step": s})
    return mgr


def _resume(root: Path, resume: str = "auto", trust: bool = False, build=lambda: _model(-1.0)) -> int | None:
    """The step resumed from (None: fresh start), checking that the weights are that checkpoint's."""
    mgr = CheckpointManager(root, Placement(), trust=trust)
    path = mgr.resolve(resume)
    if path is None:
        return None
    model, opt = build()
    state = mgr.load(path, {"m": (model, opt)})
    assert all(bool((p == state["step"]).all()) for p in model.parameters())
    assert opt.state_dict()["state"], "optimizer state restored"
    return state["step"]


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _distcp(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


def _rehash(path: Path) -> None:
    """What a crafter does: a manifest that matches the crafted files."""
    manifest = read_manifest(path)
    manifest["files"] = ckpt_mod._hash_files(path)
    (path / MANIFEST).write_text(json.dumps(manifest))


class _RunsCode:
    """Unpickling this writes `marker`: the stand-in for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _payload_is_live(tmp_path: Path) -> None:
    """The crafted payload really runs code under plain pickle (so its absence below means something)."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_RunsCode(probe)))
    assert probe.read_text() == "pwned"


# -- damaged files --------------------------------------------------------------------------------------------
def test_clear_truncated_tensor_file(tmp_path):
    _save(tmp_path, 1, 2)
    victim = _distcp(_step_dir(tmp_path, 2))
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(VerlConfigError, match=re.escape(str(victim)) + ".*truncated"):
        _resume(tmp_path, str(_step_dir(tmp_path, 2)))


def test_behaves_auto_falls_back_past_truncated(tmp_path):
    _save(tmp_path, 1, 2)
    victim = _distcp(_step_dir(tmp_path, 2))
    with open(victim, "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning, match=r"skips .*step_000002.*truncated"):
        assert _resume(tmp_path) == 1


def test_clear_flipped_byte(tmp_path):
    _save(tmp_path, 1, 2)
    victim = _distcp(_step_dir(tmp_path, 2))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(VerlConfigError, match=re.escape(str(victim)) + ".*sha256.*corrupted"):
        _resume(tmp_path, str(_step_dir(tmp_path, 2)))
    with pytest.raises(VerlConfigError, match="sha256"):  # a manifest that disagrees is refused even when trusted
        _resume(tmp_path, str(_step_dir(tmp_path, 2)), trust=True)
    with pytest.warns(UserWarning, match="corrupted"):
        assert _resume(tmp_path) == 1


@pytest.mark.parametrize("victim", ["trainer_state.json", "rng_rank0.json", ".metadata"])
def test_behaves_auto_falls_back_past_any_flipped_file(tmp_path, victim):
    _save(tmp_path, 1, 2)
    f = _step_dir(tmp_path, 2) / victim
    data = bytearray(f.read_bytes())
    data[-2] ^= 0x20
    f.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=re.escape(victim)):
        assert _resume(tmp_path) == 1


def test_behaves_auto_skips_an_empty_newer_step_dir(tmp_path):
    _save(tmp_path, 1)
    _step_dir(tmp_path, 9).mkdir()
    with pytest.warns(UserWarning, match=r"step_000009 is empty"):
        assert _resume(tmp_path) == 1


def test_clear_empty_step_dir_given_explicitly(tmp_path):
    _step_dir(tmp_path, 3).mkdir(parents=True)
    with pytest.raises(VerlConfigError, match=r"step_000003 is empty"):
        _resume(tmp_path, str(_step_dir(tmp_path, 3)))


def test_clear_not_a_directory(tmp_path):
    with pytest.raises(VerlConfigError, match=r"nope is not a directory"):
        _resume(tmp_path, str(tmp_path / "nope"))


def test_clear_missing_manifest(tmp_path):
    _save(tmp_path, 1, 2)
    (_step_dir(tmp_path, 2) / MANIFEST).unlink()
    with pytest.raises(VerlConfigError, match=r"step_000002 has no manifest.json"):
        _resume(tmp_path, str(_step_dir(tmp_path, 2)))


def test_behaves_auto_skips_missing_manifest_and_trust_loads_it(tmp_path):
    _save(tmp_path, 1, 2)
    (_step_dir(tmp_path, 2) / MANIFEST).unlink()
    with pytest.warns(UserWarning, match="no manifest.json"):
        assert _resume(tmp_path) == 1
    with pytest.warns(UserWarning, match="trust_checkpoint=true"):
        assert _resume(tmp_path, trust=True) == 2


@pytest.mark.parametrize("content, why", [("{not json", "unreadable"), ('{"format": "other"}', "not a verl"),
                                          ("", "unreadable")])
def test_clear_bad_manifest(tmp_path, content, why):
    _save(tmp_path, 1)
    (_step_dir(tmp_path, 1) / MANIFEST).write_text(content)
    with pytest.raises(VerlConfigError, match=re.escape(str(_step_dir(tmp_path, 1) / MANIFEST)) + f".*{why}"):
        _resume(tmp_path, str(_step_dir(tmp_path, 1)))


def test_clear_manifest_naming_a_file_outside(tmp_path):
    _save(tmp_path, 1)
    path = _step_dir(tmp_path, 1)
    manifest = read_manifest(path)
    manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(VerlConfigError, match="outside the checkpoint"):
        _resume(tmp_path, str(path))


def test_clear_missing_listed_file(tmp_path):
    _save(tmp_path, 1)
    (_step_dir(tmp_path, 1) / "rng_rank0.json").unlink()
    with pytest.raises(VerlConfigError, match=r"rng_rank0.json is missing"):
        _resume(tmp_path, str(_step_dir(tmp_path, 1)))


def test_clear_auto_with_no_usable_checkpoint_lists_each(tmp_path):
    _save(tmp_path, 1)
    (_step_dir(tmp_path, 1) / MANIFEST).unlink()
    _step_dir(tmp_path, 2).mkdir()
    with pytest.warns(UserWarning), pytest.raises(VerlConfigError, match=r"no usable checkpoint.*step_000002 is "
                                                  r"empty.*step_000001 has no manifest.*overwrite=true"):
        _resume(tmp_path)


def test_clear_library_error_while_loading_names_the_checkpoint(tmp_path):
    """A damaged file the manifest cannot vouch for (trusted, manifest-less): DCP raises CheckpointException,
    a BaseException; it arrives as a VerlConfigError naming the checkpoint and the fallback."""
    _save(tmp_path, 1, 2)
    path = _step_dir(tmp_path, 2)
    (path / MANIFEST).unlink()
    victim = _distcp(path)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.warns(UserWarning), pytest.raises(VerlConfigError, match=re.escape(str(path)) + ".*could not be "
                                                  r"loaded.*resume=auto falls back"):
        _resume(tmp_path, str(path), trust=True)


def test_behaves_auto_falls_back_when_a_checkpoint_fails_to_load(tmp_path):
    _save(tmp_path, 1, 2)
    path = _step_dir(tmp_path, 2)
    (path / MANIFEST).unlink()
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.warns(UserWarning, match=r"step_000002 could not be loaded"):
        assert _resume(tmp_path, trust=True) == 1


def test_clear_checkpoint_of_a_different_model(tmp_path):
    _save(tmp_path, 1)
    mgr = CheckpointManager(tmp_path, Placement())
    path = mgr.resolve("auto")
    other = torch.nn.Linear(4, 8)
    with pytest.raises(VerlConfigError, match=re.escape(str(path)) + ".*could not be loaded.*parallel layout"):
        mgr.load(path, {"m": (other, None)})


def test_behaves_stale_tmp_dir_is_ignored_then_cleaned(tmp_path, monkeypatch):
    """A save this run began and did not finish leaves a recorded .tmp- folder: ignored by resume, deleted by the
    next save; one that no run recorded stays."""
    mgr = _save(tmp_path, 1)

    def crash(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_mod.dcp, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2, mgr=mgr)
    monkeypatch.undo()
    stale, foreign = tmp_path / ".tmp-step_000002", tmp_path / ".tmp-step_000007"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not verl's")
    assert stale.is_dir() and _resume(tmp_path) == 1
    mgr = CheckpointManager(tmp_path, Placement())
    mgr.resolve("auto")
    _save(tmp_path, 3, mgr=mgr)
    assert not stale.exists() and (foreign / "notes.txt").read_text() == "not verl's"


# -- crafted pickles: refused, and the code never runs ---------------------------------------------------------
@pytest.mark.parametrize("how", ["replace", "embed"])
def test_clear_crafted_dcp_metadata_runs_no_code(tmp_path, how):
    _payload_is_live(tmp_path)
    _save(tmp_path, 1)
    path, marker = _step_dir(tmp_path, 1), tmp_path / "marker"
    if how == "replace":
        crafted = pickle.dumps(_RunsCode(marker))
    else:  # genuine DCP metadata with the payload hidden in one field
        with open(path / ".metadata", "rb") as f:
            md = ckpt_mod._MetadataUnpickler(f).load()
        md.planner_data = {"x": _RunsCode(marker)}
        crafted = pickle.dumps(md)
    (path / ".metadata").write_bytes(crafted)
    _rehash(path)  # the crafter writes a matching manifest: verification passes, unpickling must still refuse
    assert verify(path) is None
    with pytest.raises(VerlConfigError, match=r"builtins.exec is not part of DCP checkpoint metadata; refused"):
        _resume(tmp_path, str(path))
    with pytest.warns(UserWarning), pytest.raises(VerlConfigError):
        _resume(tmp_path)
    assert not marker.exists()


def test_clear_crafted_non_tensor_value_runs_no_code(tmp_path):
    """DCP pickles non-tensor values (optimizer hyper-parameters, megatron's state blob) with torch.save."""
    marker = tmp_path / "marker"

    class Engine:  # a sharded engine whose state carries the payload; the manager writes a valid manifest
        def dcp_state(self, for_load):
            return {"blob": None if for_load else _RunsCode(marker)}

        def load_dcp_state(self, state, source):
            raise AssertionError("never reached")

    mgr = CheckpointManager(tmp_path, Placement())
    model, opt = _model(1.0)
    mgr.save(1, {"m": (model, opt)}, {"eng": Engine()}, {"step": 1})
    assert verify(_step_dir(tmp_path, 1)) is None
    with pytest.raises(VerlConfigError, match=r"step_000001.*could not be loaded.*Unpickl"):
        mgr.load(mgr.resolve("auto"), {"m": _model(0.0)}, {"eng": Engine()})
    assert not marker.exists()


def test_clear_crafted_old_format_pickles_run_no_code(tmp_path):
    """trainer_state.pt / rng_rank0.pt (pickles of an older verl) are never opened, trusted or not."""
    _save(tmp_path, 1)
    path, marker = _step_dir(tmp_path, 1), tmp_path / "marker"
    for name in ("trainer_state.pt", "rng_rank0.pt"):
        (path / name).write_bytes(pickle.dumps(_RunsCode(marker)))
    (path / "trainer_state.json").unlink()
    (path / "rng_rank0.json").unlink()
    (path / MANIFEST).unlink()
    with pytest.raises(VerlConfigError, match="has no manifest.json"):
        _resume(tmp_path, str(path))
    with pytest.warns(UserWarning), pytest.raises(VerlConfigError, match=r"rng_rank0.json"):
        _resume(tmp_path, str(path), trust=True)
    assert not marker.exists()


def test_clear_crafted_training_state_runs_no_code(tmp_path):
    """Megatron's per-rank training state (save_training_state files and the blob inside DCP)."""
    marker, f = tmp_path / "marker", tmp_path / "rank_00000.pt"
    torch.save({"optimizer": _RunsCode(marker)}, f)
    with pytest.raises(VerlConfigError, match=re.escape(str(f)) + ".*refused"):
        read_plain_state(f, str(f))
    assert not marker.exists()
    torch.save({"optimizer": {"state": {(0, 1): {"exp_avg": torch.ones(2)}}, "lr": 0.1}, "layout": (1, 1, 1)}, f)
    assert read_plain_state(f, str(f))["layout"] == (1, 1, 1)  # tensors and plain values still load


# -- run ownership ---------------------------------------------------------------------------------------------
DESTINATIONS = [("metrics.jsonl", False), ("hf_actor", True)]


def _run(out: Path, keep: int = 2, resume: str | None = None, overwrite: bool = False) -> CheckpointManager:
    """A run in output folder `out` as the trainer makes it: the run manifest in `out`, checkpoints below."""
    mgr = CheckpointManager(out / "checkpoints", Placement(), keep=keep, folder=RunFolder(out))
    mgr.resolve(resume, overwrite=overwrite, destinations=DESTINATIONS)
    return mgr


def test_clear_fresh_run_refuses_a_used_folder(tmp_path):
    _save(tmp_path / "checkpoints", 1, mgr=_run(tmp_path))
    with pytest.raises(VerlConfigError, match=re.escape(str(tmp_path)) + r".*holds an earlier run.*resume=auto.*"
                                                                         r"overwrite=true"):
        _run(tmp_path)
    assert _step_dir(tmp_path / "checkpoints", 1).is_dir()  # nothing touched


def test_clear_fresh_run_refuses_metrics_no_run_recorded(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    for overwrite in (False, True):  # overwrite deletes only what a run recorded
        with pytest.raises(VerlConfigError, match=r"no run recorded.*metrics.jsonl.*move them away"):
            _run(tmp_path, overwrite=overwrite)
    assert metrics.read_text() == '{"step": 1}\n'


def test_behaves_overwrite_replaces_the_earlier_run(tmp_path):
    root, metrics = tmp_path / "checkpoints", tmp_path / "metrics.jsonl"
    first = _run(tmp_path)
    first.folder.record("metrics.jsonl", "file")
    metrics.write_text('{"step": 5}\n')
    _save(root, 5, mgr=first)  # the earlier run got further than the new one will
    with pytest.warns(UserWarning, match="deleting the earlier run"):
        mgr = _run(tmp_path, overwrite=True)
    assert not metrics.exists() and not root.exists()
    _save(root, 1, mgr=mgr)
    assert [p.name for p in mgr.list()] == ["step_000001"]  # not the earlier run's step 5
    assert CheckpointManager(root, Placement(), folder=RunFolder(tmp_path)).resolve("auto") == _step_dir(root, 1)


def test_behaves_pruning_spares_another_runs_checkpoint(tmp_path):
    other = _save(tmp_path / "a", 1, keep=1)  # run A, elsewhere
    mgr = _run(tmp_path / "b", keep=1)
    _save(tmp_path / "b" / "checkpoints", 2, mgr=mgr)
    shutil.copytree(_step_dir(tmp_path / "a", 1), _step_dir(tmp_path / "b" / "checkpoints", 1))  # copied in
    _save(tmp_path / "b" / "checkpoints", 3, 4, mgr=mgr)
    assert [p.name for p in mgr.list()] == ["step_000001", "step_000004"]
    assert read_manifest(_step_dir(tmp_path / "b" / "checkpoints", 1))["run_id"] == other.run_id != mgr.run_id


def test_behaves_resumed_run_keeps_its_run_id_and_prunes_its_own(tmp_path):
    first = _save(tmp_path, 1, 2, keep=2)
    mgr = CheckpointManager(tmp_path, Placement(), keep=2)
    mgr.resolve("auto")
    assert mgr.run_id == first.run_id
    _save(tmp_path, 3, mgr=mgr)
    assert [p.name for p in mgr.list()] == ["step_000002", "step_000003"]


# -- replacing a step: no moment at which a kill loses it --------------------------------------------------------
@pytest.mark.parametrize("kill_after", ["first_rename", "second_rename"])
def test_behaves_replace_is_safe(tmp_path, monkeypatch, kill_after):
    mgr = _save(tmp_path, 1, 2)
    renames = []
    real_rename, real_delete = os.rename, RunFolder._delete

    class Killed(BaseException):
        pass

    def rename(src, dst):
        real_rename(src, dst)
        if Path(src).name.startswith(("step_", ".tmp-step_")):  # the manager's, not DCP's own file renames
            renames.append(dst)
            if kill_after == "first_rename" and len(renames) == 1:
                raise Killed

    def delete(self, rel, kind):
        if kill_after == "second_rename" and Path(rel).name.startswith(".old-"):
            raise Killed
        return real_delete(self, rel, kind)

    monkeypatch.setattr(ckpt_mod.os, "rename", rename)
    monkeypatch.setattr(RunFolder, "_delete", delete)
    with pytest.raises(Killed):
        _save(tmp_path, 2, mgr=mgr)  # a resumed run re-saving step 2
    monkeypatch.undo()
    assert len(list(tmp_path.glob(".old-step_000002-*"))) == 1
    restored = kill_after == "first_rename"  # the old copy is the only one: renamed back, with a warning
    with pytest.warns(UserWarning, match="restored") if restored else contextlib.nullcontext():
        assert _resume(tmp_path) == 2
    assert not list(tmp_path.glob(".old-step_000002*"))


# -- RNG ---------------------------------------------------------------------------------------------------------
def test_behaves_rng_states_round_trip_exactly(tmp_path):
    random.random(), np.random.normal(), torch.rand(1)  # a cached Gaussian and advanced generators
    state = json.loads(json.dumps(ckpt_mod.rng_state()))
    want = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    ckpt_mod.set_rng_state(state)
    got = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


# -- metrics -----------------------------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_behaves_torn_last_metrics_line_is_kept_and_skipped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    before = '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"'
    path.write_text(before)
    with pytest.warns(UserWarning, match="cut short"):
        logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, start_step=2)
    logger.log(3, {"a": 3.5})
    assert path.read_text().startswith(before + "\n")  # append-only: not a byte of the earlier text changed
    with pytest.warns(UserWarning, match="torn line 3"):
        assert metrics_view(read_metrics(path)) == [{"step": 1, "a": 1.0},
                                                    {"step": 2, "a": 2.0, "resumed_from_step": 2},
                                                    {"step": 3, "a": 3.5}]
    with pytest.warns(UserWarning, match="torn"):  # the plot's reader tolerates a torn last line too
        path.write_text(path.read_text() + '{"st')
        assert len(read_metrics(path)) == 4


def test_clear_unreadable_metrics_line_inside_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(VerlConfigError, match=re.escape(str(path)) + " line 2"):
        read_metrics(path)


def test_behaves_metrics_one_row_per_step_after_resume(tmp_path):
    """The resumed run redoes steps 3 and 4: its rows replace theirs in the view; the file keeps all of them."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "warmup/loss": 1.0}] + [{"step": s, "a": float(s)} for s in (1, 2, 3, 4)]
    earlier = "".join(json.dumps(r) + "\n" for r in rows + [{"step": 2, "b": 9.0}])
    path.write_text(earlier)
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, start_step=2)  # resumed from step 2
    logger.log(3, {"a": 30.0})
    assert path.read_text().startswith(earlier) and len(_rows(path)) == 8
    got = metrics_view(read_metrics(path))
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert got[2] == {"step": 2, "a": 2.0, "b": 9.0, "resumed_from_step": 2}
    assert got[3] == {"step": 3, "a": 30.0}


# -- the trainer: a fresh run in a used folder -------------------------------------------------------------------
def test_clear_trainer_refuses_a_used_output_dir_and_overwrite_restarts(tmp_path):
    from tests.trainer.conftest import TINY
    from verl.trainer.main_ppo import main
    args = [*TINY, "trainer.total_steps=1", "warmup.steps=0", "trainer.export_hf=false", "trainer.plot=false",
            f"trainer.output_dir={tmp_path}"]
    main(args)
    first = read_manifest(_step_dir(tmp_path / "checkpoints", 1))["run_id"]
    with pytest.raises(VerlConfigError, match=r"holds an earlier run.*resume=auto.*overwrite=true"):
        main(args)
    assert read_manifest(_step_dir(tmp_path / "checkpoints", 1))["run_id"] == first
    with pytest.warns(UserWarning, match="deleting"):
        main([*args, "trainer.overwrite=true"])
    assert read_manifest(_step_dir(tmp_path / "checkpoints", 1))["run_id"] != first
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl") if "reward/mean" in r] == [1]


# -- SIGKILL at random moments of a save -------------------------------------------------------------------------
def test_behaves_kill_during_save_always_leaves_a_valid_checkpoint(tmp_path):
    """VERL_KILL_LOOP_N kills (default 10), each at a random moment while a process saves over and over;
    after each one resume=auto must find a complete checkpoint at least as new as the last save reported."""
    n = int(os.environ.get("VERL_KILL_LOOP_N", "10"))
    seed = int(os.environ.get("VERL_KILL_LOOP_SEED", str(time.time_ns() % 10_000)))
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    last_saved, mid_save, resumed = 0, 0, []
    for _ in range(n):
        started = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "tests.reliability._save_loop", str(tmp_path)], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().startswith("ready"), "the saving process did not start"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        out, _ = proc.communicate()
        saved = [int(line.split()[1]) for line in out.splitlines() if line.startswith("saved ")]
        last_saved = max([last_saved, *saved])
        mid_save += any(p.stat().st_mtime >= started for p in tmp_path.glob(".tmp-step_*"))  # this process's
        step = _resume(tmp_path, build=build)
        assert (step or 0) >= last_saved, f"seed {seed}: resumed step {step}, but step {last_saved} was saved"
        resumed.append(step)
    print(f"\nkill-during-save: {n} kills (seed {seed}), {mid_save} inside a save; every resume=auto found a valid "
          f"checkpoint at or after the last reported save (resumed steps {resumed})")


# -- two ranks: every rank reaches the same decision, nobody hangs ------------------------------------------------
def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    root, world = Path(root), Placement(rank=rank, world_size=world_size, dp_size=world_size, dp_rank=rank)
    _save(root, 1, 2, mgr=CheckpointManager(root, world))
    out = {}
    if rank == 0:
        victim = sorted(_step_dir(root, 2).glob("*.distcp"))[-1]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        CheckpointManager(root, world).resolve(str(_step_dir(root, 2)))
    except VerlConfigError as e:
        out["explicit"] = str(e)
    mgr = CheckpointManager(root, world)
    model, opt = _model(-1.0)
    out["auto"] = mgr.load(mgr.resolve("auto"), {"m": (model, opt)})["step"]
    if rank == 0:  # the newest verifies no more, and fails to load: the fall-back is collective too
        (_step_dir(root, 2) / MANIFEST).unlink()
        (_step_dir(root, 2) / ".metadata").write_bytes(b"\x80\x04garbage")
    dist.barrier()
    mgr = CheckpointManager(root, world, trust=True)
    out["fallback"] = mgr.load(mgr.resolve("auto"), {"m": (model, opt)})["step"]
    out["weights"] = model.weight[0, 0].item()
    return out


@pytest.mark.multiprocess
def test_behaves_two_ranks_agree_on_refusal_and_fallback(tmp_path):
    from verl.testing.distributed import run_distributed
    r0, r1 = run_distributed(_two_ranks, 2, args=(str(tmp_path),), timeout=120)
    assert "sha256" in r0["explicit"] and "rank 0 could not resolve" in r1["explicit"]
    assert r0["auto"] == r1["auto"] == 1
    assert r0["fallback"] == r1["fallback"] == 1 and r0["weights"] == r1["weights"] == 1.0
