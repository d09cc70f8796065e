"""A run touches only what it wrote (issue #32) and restores only checked values (issue #31, item 8).

Decoy files of other people and tools sit in the output folder while verl overwrites, prunes, exports, resumes,
plots and traces: every decoy must be intact afterwards, byte for byte, and the run's own files replaced or
deleted as documented. Dangerous output folders are refused when the config is loaded; sizes are bounded;
restored values are checked for type and range; a checkpoint resumed on another number of processes is
resharded with the documented RNG rule, or refused naming both sizes.

Count the cases: pytest --collect-only -q tests/reliability/test_output_ownership.py | grep -c "clear\\|behaves"
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.config.base import from_dict
from verl.data.dataset import BatchSampler
from verl.distributed import Placement
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.trainer.kl_control import FixedKLController
from verl.trainer.ppo_trainer import PPOTrainer
from verl.utils import checkpoint as ckpt_mod
from verl.utils.checkpoint import MANIFEST, CheckpointManager, derived_seed, read_manifest, seed_rng
from verl.utils.metrics import metrics_view, read_metrics
from verl.utils.run_folder import RUN_MANIFEST, RunFolder, check_output_dir
from verl.utils.state_check import StateError, json_size

from tests.trainer.conftest import TINY

REPO = Path(__file__).resolve().parents[2]
ALL_OUTPUTS = ["warmup.steps=0", "trainer.total_steps=1", "trainer.tensorboard=true", "trainer.trace_step=1",
               "trainer.export_hf=true", "trainer.plot=true"]


# -- helpers --------------------------------------------------------------------------------------------------
def _train(out: Path, *extra: str) -> None:
    from verl.trainer.main_ppo import main
    main([*TINY, *ALL_OUTPUTS, f"trainer.output_dir={out}", *extra])


def _decoys(out: Path, *rels: str) -> dict[Path, bytes]:
    """Files of someone else's at `rels`, each with unique content; returns what each must still hold."""
    made = {}
    for rel in rels:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"not verl's: {rel}".encode())
        made[path] = path.read_bytes()
    return made


def _intact(decoys: dict[Path, bytes]) -> None:
    for path, content in decoys.items():
        assert path.is_file() and path.read_bytes() == content, f"decoy {path} was touched"


def _run_id(out: Path) -> str:
    return json.loads((out / RUN_MANIFEST).read_text())["run_id"]


def _step(out: Path, n: int) -> Path:
    return out / "checkpoints" / f"step_{n:06d}"


# -- the decoy table: overwrite, prune, export, resume, plot, trace -------------------------------------------
def test_behaves_overwrite_deletes_only_the_earlier_runs_files(tmp_path):
    out = tmp_path / "out"
    _train(out)
    first, first_trace = _run_id(out), (out / "trace_step_1.json").read_bytes()
    decoys = _decoys(out, "my_notes.txt", "checkpoints/my_notes.txt", "checkpoints/other_model/weights.bin",
                     "tensorboard/their.tfevents", "hf_actor_backup/model.safetensors")
    with pytest.warns(UserWarning) as caught:
        _train(out, "trainer.overwrite=true")
    said = " | ".join(str(w.message) for w in caught)
    assert "deleting the earlier run" in said
    assert re.search(r"kept .*checkpoints: it holds files no verl run recorded \(my_notes.txt, other_model\)", said)
    assert re.search(r"kept .*tensorboard: it holds files no verl run recorded \(their.tfevents\)", said)
    _intact(decoys)
    assert _run_id(out) != first and read_manifest(_step(out, 1))["run_id"] == _run_id(out)
    assert (out / "trace_step_1.json").read_bytes() != first_trace  # the earlier run's trace went with it
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [1]


def test_behaves_pruning_deletes_only_the_runs_own_checkpoints(tmp_path):
    out = tmp_path / "out"
    decoys = _decoys(out, "checkpoints/my_notes.txt", "checkpoints/other_model/weights.bin")
    _train(out, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=1")
    _intact(decoys)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "my_notes.txt", "other_model",
                                                                        "step_000003"]


def test_behaves_pruning_keeps_a_file_added_to_a_step_folder(tmp_path):
    mgr = CheckpointManager(tmp_path, Placement(), keep=1)
    model = torch.nn.Linear(2, 2)
    mgr.save(1, {"m": (model, None)}, {}, {"step": 1})
    decoys = _decoys(tmp_path, "step_000001/notes.txt")
    with pytest.warns(UserWarning, match=r"kept .*step_000001: it holds files no verl run recorded \(notes.txt\)"):
        mgr.save(2, {"m": (model, None)}, {}, {"step": 2})
    _intact(decoys)
    assert sorted(p.name for p in (tmp_path / "step_000001").iterdir()) == ["notes.txt"]  # verl's files gone


def test_clear_resume_auto_refuses_another_runs_checkpoint_copied_in(tmp_path):
    """Not resumed from (it is another run's), and in the way of the run's own step 5: refused, untouched."""
    mine = CheckpointManager(tmp_path / "mine", Placement())
    mine.resolve(None)
    mine.save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 1})
    CheckpointManager(tmp_path / "other", Placement()).save(5, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 5})
    import shutil
    shutil.copytree(tmp_path / "other" / "step_000005", tmp_path / "mine" / "step_000005")
    with pytest.warns(UserWarning, match=r"skips .*step_000005: .*belongs to run .*, not to this folder's run"), \
            pytest.raises(VerlConfigError, match=r"files that no run recorded .* where this run writes: step_000005"):
        CheckpointManager(tmp_path / "mine", Placement()).resolve("auto")
    assert read_manifest(tmp_path / "mine" / "step_000005")["step"] == 5


def test_behaves_empty_folder_at_a_steps_path_is_replaced_with_a_warning(tmp_path):
    mgr = CheckpointManager(tmp_path, Placement())
    mgr.save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 1})
    (tmp_path / "step_000002").mkdir()
    mgr = CheckpointManager(tmp_path, Placement())
    with pytest.warns(UserWarning, match=r"skips .*step_000002 is empty"):
        mgr.resolve("auto")
    with pytest.warns(UserWarning, match=r"replacing the empty folder .*step_000002"):
        mgr.save(2, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 2})
    assert read_manifest(tmp_path / "step_000002")["run_id"] == mgr.run_id


def test_clear_a_step_folder_of_someone_elses_is_never_replaced(tmp_path):
    mgr = CheckpointManager(tmp_path, Placement())
    mgr.save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 1})
    decoys = _decoys(tmp_path, "step_000002/weights.bin")  # appeared during the run
    with pytest.raises(VerlRuntimeError, match=r"checkpoint of step 2 not written: .*step_000002 exists and is not "
                                               r"this run's"):
        mgr.save(2, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 2})
    _intact(decoys)


@pytest.mark.parametrize("rel", ["hf_actor/my_model.safetensors", "curves.png", "metrics.jsonl",
                                 "checkpoints/latest", "checkpoints/step_000001/weights.bin", "hang/rank_0.txt"])
def test_clear_fresh_run_refuses_a_foreign_file_where_it_writes(tmp_path, rel):
    """Export, plot, metrics, checkpoints: a file of someone else's in the way stops the run before step 1."""
    out = tmp_path / "out"
    decoys = _decoys(out, rel)
    with pytest.raises(VerlConfigError, match=r"files that no run recorded \(verl_run.json\) where this run writes: "
                                              + re.escape(rel.split("/weights")[0]) + r".*move them away"):
        _train(out)
    _intact(decoys)
    assert sorted(p.name for p in out.iterdir()) == [rel.split("/")[0]]  # nothing written: refused before any work


def test_clear_export_refuses_a_file_added_to_the_runs_hf_actor(tmp_path):
    out = tmp_path / "out"
    _train(out)
    own = {p.name: p.read_bytes() for p in (out / "hf_actor").iterdir()}
    decoys = _decoys(out, "hf_actor/my_model.safetensors")
    with pytest.raises(VerlConfigError, match=r"hf_actor/my_model.safetensors"):
        _train(out, "trainer.resume=auto", "trainer.total_steps=2")
    _intact(decoys)
    assert {p.name: p.read_bytes() for p in (out / "hf_actor").iterdir() if p.name in own} == own


def test_behaves_export_replaces_the_runs_own_copy_through_a_sibling(tmp_path):
    out = tmp_path / "out"
    _train(out, "actor.optim.lr=0.05")
    before = (out / "hf_actor" / "model.safetensors").read_bytes()
    decoys = _decoys(out, "my_notes.txt", ".tmp-hf_actor-notmine/keep.txt")
    _train(out, "trainer.resume=auto", "trainer.total_steps=2", "actor.optim.lr=0.05")
    _intact(decoys)
    assert (out / "hf_actor" / "model.safetensors").read_bytes() != before  # the new weights
    assert not [p for p in out.iterdir() if p.name.startswith((".old-", ".tmp-hf_actor")) and "notmine" not in p.name]


def test_behaves_export_failure_leaves_the_new_copy_beside(tmp_path):
    folder = RunFolder(tmp_path)
    folder.start("ab" * 16, "fresh")
    folder.record("hf_actor", "dir")
    (tmp_path / "hf_actor").mkdir()
    decoys = _decoys(tmp_path, "hf_actor/my_model.safetensors")  # appeared during the run
    folder.record(".tmp-hf_actor-1", "tree")
    _decoys(tmp_path, ".tmp-hf_actor-1/model.safetensors")
    with pytest.raises(VerlRuntimeError, match=r"hf_actor holds files this run did not write \(hf_actor/my_model"
                                               r".safetensors\).*the new export is in .*\.tmp-hf_actor-1"):
        folder.publish(".tmp-hf_actor-1", "hf_actor")
    _intact(decoys)
    assert (tmp_path / ".tmp-hf_actor-1" / "model.safetensors").is_file()


def test_clear_resume_without_a_checkpoint_keeps_the_earlier_history(tmp_path):
    """The audit's case: resume=auto over an earlier run's 3 metrics rows and no checkpoint truncated them to 1."""
    out = tmp_path / "out"
    _train(out, "trainer.total_steps=3", "trainer.save_final=false")
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(VerlConfigError, match=r"resume=auto found no checkpoint to resume from.*holds an earlier "
                                              r"run's history \(.*metrics.jsonl.*\)"):
        _train(out, "trainer.total_steps=3", "trainer.resume=auto")
    assert (out / "metrics.jsonl").read_bytes() == before
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3]


def test_clear_resume_without_a_checkpoint_refuses_foreign_metrics(tmp_path):
    out = tmp_path / "out"
    decoys = _decoys(out, "metrics.jsonl")
    with pytest.raises(VerlConfigError, match=r"holds an earlier run's history \(metrics.jsonl\)"):
        _train(out, "trainer.resume=auto")
    _intact(decoys)


def test_behaves_resume_appends_history_never_rewrites_it(tmp_path):
    out = tmp_path / "out"
    _train(out, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=0")
    history = {p: p.read_bytes() for p in [out / "metrics.jsonl", out / "trace_step_1.json",
                                           *(out / "tensorboard").iterdir()]}
    curves, step3 = (out / "curves.png").stat().st_ino, read_manifest(_step(out, 3))
    # resumed from step 1: steps 2 and 3 are redone, and their checkpoints (the run's own) replaced
    _train(out, "trainer.total_steps=3", f"trainer.resume={_step(out, 1)}", "trainer.trace_step=2")
    assert read_manifest(_step(out, 3))["files"] != step3["files"]
    for path, content in history.items():  # metrics appended to, trace and event files untouched
        assert path.read_bytes()[:len(content)] == content, f"{path} was rewritten"
    assert (out / "trace_step_2.json").is_file()
    assert (out / "curves.png").stat().st_ino != curves  # the run's own plot, redrawn (beside, then renamed)
    view = metrics_view(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in view if "reward/mean" in r] == [1, 2, 3]
    rows = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert rows == [1, 2, 3, 2, 3]  # all kept: the first session's 1-3, the resumed one's 2-3


def test_behaves_a_run_that_does_not_plot_writes_beside_a_foreign_curves_png(tmp_path):
    out = tmp_path / "out"
    decoys = _decoys(out, "curves.png")
    _train(out, "trainer.plot=false")
    _intact(decoys)


def test_behaves_trace_is_written_beside_a_foreign_one(tmp_path):
    out = tmp_path / "out"
    decoys = _decoys(out, "trace_step_1.json", "trace_step_1-2_rollout.json")
    _train(out)
    _intact(decoys)
    trace = json.loads((out / "trace_step_1-3.json").read_text())
    assert any(e.get("name") == "generate" for e in trace["traceEvents"])
    assert json.loads((out / RUN_MANIFEST).read_text())["entries"]["trace_step_1-3.json"] == "file"


# -- dangerous destinations, refused when the config is loaded ------------------------------------------------
def _load(output_dir: str) -> PPOConfig:
    return load_config(PPOConfig, None, [f"trainer.output_dir={output_dir}"])


@pytest.mark.parametrize("value, why", [
    ("/", r"'/' is the filesystem root"),
    (str(Path.home()), r"is your home directory"),
    (str(REPO), r"is the verl checkout"),
    (f"{REPO}/outputs/..", r"\(resolves to " + re.escape(str(REPO)) + r"\) is the verl checkout"),
    (str(REPO / "verl" / "runs"), r"is inside verl's own sources"),
    ("", r"is empty, which would write the run into the current directory"),
    ("~/runs", r"'~' is not expanded here"),
])
def test_clear_dangerous_output_dir_refused_on_load(value, why):
    with pytest.raises(VerlConfigError, match=r"trainer.output_dir.*" + why):
        _load(value)


def test_clear_output_dir_above_home_refused(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(VerlConfigError, match=r"is a folder above your home directory"):
        _load(str(tmp_path / "home"))
    assert _load(str(home / "runs" / "a")).trainer.output_dir.endswith("runs/a")  # inside home is fine


def test_clear_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(VerlConfigError, match=r"is a file, not a folder"):
        _load(str(tmp_path / "f"))


@pytest.mark.parametrize("link", ["checkpoints", "hf_actor", "metrics.jsonl", "checkpoints/step_000001",
                                  "trace_step_3.json"])
def test_clear_symlink_leaving_the_output_folder_refused(tmp_path, link):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    decoys = _decoys(elsewhere, "precious.bin")
    (out / link).parent.mkdir(parents=True, exist_ok=True)
    (out / link).symlink_to(elsewhere)
    with pytest.raises(VerlConfigError, match=re.escape(str(out / link)) + r" is a symbolic link to " +
                       re.escape(str(elsewhere)) + r", outside the output folder"):
        _load(str(out))
    _intact(decoys)


def test_behaves_symlinks_inside_the_output_folder_and_to_it_are_fine(tmp_path):
    real = tmp_path / "real"
    (real / "ckpt").mkdir(parents=True)
    (real / "checkpoints").symlink_to(real / "ckpt")
    (tmp_path / "link").symlink_to(real)  # the output folder itself behind a link (scratch space): fine
    assert check_output_dir(str(tmp_path / "link")) == real


def test_clear_verl_train_prints_the_refusal(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "verl.cli.main", "train", "trainer.output_dir=/"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert "verl train: config error: trainer.output_dir='/' is the filesystem root" in proc.stderr


# -- bounded state ---------------------------------------------------------------------------------------------
def _alias_bomb(levels: int = 30, width: int = 10) -> list:
    """What a YAML alias bomb parses to: each level a list holding the previous one `width` times (shared)."""
    node: list = ["lol"]
    for _ in range(levels):
        node = [node] * width
    return node


def test_behaves_json_size_of_an_alias_bomb_is_measured_without_expanding_it():
    bomb = _alias_bomb(levels=8, width=4)
    assert json_size(bomb) == len(json.dumps(bomb, separators=(",", ":")))
    mixed = {"a": [1, 2.5, None, True, False, "é\n"], "b": {}, "c": [], 7: {"d": [bomb[0]] * 3}}
    assert json_size(mixed) == len(json.dumps(mixed, separators=(",", ":")))
    with pytest.raises(StateError, match=r"above the limit"):
        json_size(_alias_bomb(), limit=1 << 20)  # 10**30 copies: refused at once


def test_clear_alias_bomb_in_a_free_form_config_section(tmp_path):
    with pytest.raises(VerlConfigError, match=r"config key 'rollout.engine_kwargs.x.*' holds about .* MB of JSON, "
                                              r"above the limit of 16.0 MB, so the copy of the config every "
                                              r"checkpoint stores would be too big"):
        from_dict(PPOConfig, {"rollout": {"engine_kwargs": {"x": _alias_bomb()}}})


def test_clear_recursive_alias_in_a_config(tmp_path):
    loop: list = []
    loop.append(loop)
    with pytest.raises(VerlConfigError, match=r"config key 'rollout.engine_kwargs.a\[0\]' contains itself"):
        from_dict(PPOConfig, {"rollout": {"engine_kwargs": {"a": loop}}})


def test_clear_trainer_state_above_its_bound_is_not_written(tmp_path):
    mgr = CheckpointManager(tmp_path, Placement(), max_state_bytes=1 << 20)
    state = {"step": 1, "flow_state": [{"carried": {"batch": ["x" * (2 << 20)]}}]}
    with pytest.raises(VerlRuntimeError, match=r"checkpoint of step 1: flow_state\[0\].carried.batch: holds about "
                                               r"2.0 MB of JSON, above the limit of 1.0 MB, so trainer_state.json "
                                               r"would be too big; raise trainer.max_state_mb \(now 1\)"):
        mgr.save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, state)
    assert not list(tmp_path.glob("step_*")) and not list(tmp_path.glob(".tmp-*"))


def test_clear_trainer_state_above_its_bound_is_not_read(tmp_path):
    model = torch.nn.Linear(2, 2)
    CheckpointManager(tmp_path, Placement()).save(1, {"m": (model, None)}, {}, {"step": 1, "pad": "x" * (3 << 20)})
    mgr = CheckpointManager(tmp_path, Placement(), max_state_bytes=1 << 20)
    with pytest.raises(VerlConfigError, match=r"trainer_state.json: 3.0 MB, above the limit of 1.0 MB for this file; "
                                              r"refused unread \(trainer.max_state_mb\)"):
        mgr.load(mgr.resolve("auto"), {"m": (model, None)})


def test_clear_max_state_mb_range():
    with pytest.raises(VerlConfigError, match=r"trainer.max_state_mb"):
        load_config(PPOConfig, None, ["trainer.max_state_mb=0"])


# -- restored values: type and range (issue #31, item 8) --------------------------------------------------------
def _trainer_spec():
    """The trainer's own spec, for a 64-row dataset."""
    fake = SimpleNamespace(sampler=BatchSampler(64, 4, seed=1), kl_ctrl=FixedKLController(0.001))
    return PPOTrainer._state_spec(fake)


def _craft(root: Path, edit) -> Path:
    """A checkpoint whose trainer_state.json `edit` changed, with a manifest that matches (what a crafter does)."""
    model, opt = torch.nn.Linear(2, 2), None
    CheckpointManager(root, Placement()).save(
        2, {"m": (model, opt)}, {},
        {"step": 2, "sampler": {"epoch": 0, "cursor": 8}, "kl_ctrl": {"value": 0.001},
         "actor_sched": {"base_lrs": [0.001], "last_epoch": 2, "_step_count": 3, "_last_lr": [0.001],
                         "lr_lambdas": [None]},
         "critic_sched": None, "config": {}, "generation_lag": 0, "flow_state": [None]})
    path = root / "step_000002"
    state = json.loads((path / "trainer_state.json").read_text())
    edit(state)
    (path / "trainer_state.json").write_text(json.dumps(state))
    manifest = read_manifest(path)
    manifest["files"] = ckpt_mod._hash_files(path)
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def _set(key: str, value):
    def edit(state):
        *parents, last = key.split(".")
        node = state
        for k in parents:
            node = node[k]
        node[last] = value
    return edit


CRAFTED = [
    ("step", 1e30, r"step: 1e\+30: must be an integer in \[0, 1099511627776\]"),
    ("step", -3, r"step: -3: must be an integer in \[0, 1099511627776\]"),
    ("step", True, r"step: True: must be an integer"),
    ("step", 3, r"step 3 disagrees with its manifest's step 2"),
    ("sampler.cursor", 65, r"sampler.cursor: 65: must be an integer in \[0, 64\]"),
    ("sampler.epoch", "0", r"sampler.epoch: '0': must be an integer"),
    ("kl_ctrl.value", float("nan"), r"kl_ctrl.value: nan: must be a finite number in \[0.0, inf\]"),
    ("kl_ctrl.value", -1.0, r"kl_ctrl.value: -1.0: must be a finite number"),
    ("actor_sched.last_epoch", 1e30, r"actor_sched.last_epoch: 1e\+30: must be an integer"),
    ("actor_sched.base_lrs", [-0.1], r"actor_sched.base_lrs\[0\]: -0.1: must be a finite number"),
    ("actor_sched.evil", {"__class__": "x"}, r"actor_sched.evil: .*must be a finite number, a string"),
    ("generation_lag", -1, r"generation_lag: -1: must be an integer"),
    ("flow_state", [{"runs": 1, "carried": {"batch": [{"__tensor__": "AAAA", "dtype": "load", "shape": [3]}]}}],
     r"flow_state\[0\].carried.batch\[0\]: not a stored tensor"),
    ("flow_state", [{"runs": 1, "carried": {"batch": [{"__tensor__": "AAAA", "dtype": "int64", "shape": [3]}]}}],
     r"flow_state\[0\].carried.batch\[0\]: 3 bytes for a int64 tensor of shape \[3\], which needs 24"),
    ("flow_state", [{"runs": 1, "carried": {"b": [{"__rollout_batch__": {"evil": 1}}]}}],
     r"flow_state\[0\].carried.b\[0\]: a batch with fields other than RolloutBatch's"),
    ("sampler", None, r"sampler: None: must be a JSON object"),
    ("surprise", 1, r"surprise: unexpected key"),
]


@pytest.mark.parametrize("key, value, why", CRAFTED, ids=[f"{k}={str(v)[:20]}" for k, v, _ in CRAFTED])
def test_clear_crafted_trainer_state_value_refused(tmp_path, key, value, why):
    path = _craft(tmp_path, _set(key, value))
    mgr = CheckpointManager(tmp_path, Placement())
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(7.0)
    with pytest.raises(VerlConfigError, match=re.escape(str(path)) + r"' could not be loaded: trainer_state.json: "
                       + why):
        mgr.load(path, {"m": (model, None)}, state_spec=_trainer_spec())
    assert bool((model.weight == 7.0).all()), "nothing is restored from a checkpoint whose state is refused"


@pytest.mark.parametrize("field, value, why", [
    ("python.state", [1, 2, 3], r"python.state: a list of 3 items: must hold exactly 625"),
    ("python.version", 2, r"python.version: 2: must be an integer in \[3, 3\]"),
    ("numpy.pos", 10**6, r"numpy.pos: 1000000: must be an integer in \[0, 624\]"),
    ("torch", "AAAA", r"torch: holds 3 bytes of generator state, not 5056"),
])
def test_clear_crafted_rng_state_refused(tmp_path, field, value, why):
    CheckpointManager(tmp_path, Placement()).save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 1})
    path = tmp_path / "step_000001"
    rng = json.loads((path / "rng_rank0.json").read_text())
    _set(field, value)(rng)
    (path / "rng_rank0.json").write_text(json.dumps(rng))
    manifest = read_manifest(path)
    manifest["files"] = ckpt_mod._hash_files(path)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(VerlConfigError, match=r"rng_rank0.json: " + why):
        CheckpointManager(tmp_path, Placement()).load(path, {"m": (torch.nn.Linear(2, 2), None)})


@pytest.mark.parametrize("field, value, why", [
    ("world_size", 0, r"world_size: 0: must be an integer in \[1, 1048576\]"),
    ("step", -1, r"step: -1: must be an integer"),
    ("run_id", "../../x", r"run_id: '../../x': must match"),
])
def test_clear_crafted_manifest_value_refused(tmp_path, field, value, why):
    CheckpointManager(tmp_path, Placement()).save(1, {"m": (torch.nn.Linear(2, 2), None)}, {}, {"step": 1})
    path = tmp_path / "step_000001"
    manifest = read_manifest(path)
    manifest[field] = value
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(VerlConfigError, match=r"is not a valid verl-checkpoint-v1 manifest: " + why):
        CheckpointManager(tmp_path, Placement()).resolve(str(path))


def test_clear_trainer_refuses_a_negative_step_before_training(tmp_path):
    """The audit's case end to end: a crafted step=-3 with a matching manifest trained 8 steps from step -3."""
    out = tmp_path / "out"
    _train(out, "trainer.export_hf=false")
    path = _step(out, 1)
    state = json.loads((path / "trainer_state.json").read_text())
    state["step"] = -3
    (path / "trainer_state.json").write_text(json.dumps(state))
    manifest = read_manifest(path)
    manifest["files"] = ckpt_mod._hash_files(path)
    (path / MANIFEST).write_text(json.dumps(manifest))
    rows = len(read_metrics(out / "metrics.jsonl"))
    with pytest.raises(VerlConfigError, match=r"trainer_state.json: step: -3: must be an integer in \[0, "):
        _train(out, "trainer.export_hf=false", "trainer.total_steps=5", f"trainer.resume={path}")
    assert len(read_metrics(out / "metrics.jsonl")) == rows  # not a step was run


# -- world size on resume: resharded with the RNG rule, or refused naming both sizes -----------------------------
def _save_on_ranks(rank: int, world_size: int, root: str, sharded: bool) -> float:
    world = Placement(rank=rank, world_size=world_size, dp_size=world_size, dp_rank=rank)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(3.0)
    engines = {"actor": _RankKeyed(rank)} if sharded else {}
    torch.manual_seed(100 + rank)
    CheckpointManager(root, world).save(4, {"m": (model, opt)}, engines, {"step": 4})
    return torch.rand(1).item()  # what this rank's generator gives right after the save


class _RankKeyed:
    """A sharded engine as megatron's: each rank's state under a key of its own."""

    def __init__(self, rank: int):
        self.rank = rank

    def dcp_state(self, for_load):
        return {f"shard_{self.rank}": torch.full((2,), float(self.rank))}

    def load_dcp_state(self, state, source):
        pass


@pytest.mark.multiprocess
def test_behaves_two_rank_checkpoint_resumes_on_one_process(tmp_path):
    from verl.testing.distributed import run_distributed
    after = run_distributed(_save_on_ranks, 2, args=(str(tmp_path), False), timeout=120)
    mgr = CheckpointManager(tmp_path, Placement(), seed=1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"written by 2 processes, on 1: DCP reshards the model and optimizer states "
                                         r"by name; RNG: ranks 0..0 restore their own saved states, the saved states "
                                         r"of ranks 1..1 are unused"):
        state = mgr.load(mgr.resolve("auto"), {"m": (model, opt)})
    assert state["step"] == 4 and mgr.saved_world_size == 2
    assert bool((model.weight == 3.0).all()) and opt.state_dict()["state"]
    assert torch.rand(1).item() == after[0]  # rank 0's own generator, continued


def _load_on_ranks(rank: int, world_size: int, root: str) -> tuple[float, float]:
    import warnings
    world = Placement(rank=rank, world_size=world_size, dp_size=world_size, dp_rank=rank)
    mgr = CheckpointManager(root, world, seed=1)
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.load(mgr.resolve("auto"), {"m": (model, None)})
    return torch.rand(1).item(), model.weight[0, 0].item()


@pytest.mark.multiprocess
def test_behaves_one_rank_checkpoint_resumes_on_two_with_derived_rng(tmp_path):
    torch.manual_seed(100)
    CheckpointManager(tmp_path, Placement()).save(4, {"m": (torch.nn.Linear(4, 4), None)}, {}, {"step": 4})
    want0 = torch.rand(1).item()
    from verl.testing.distributed import run_distributed
    (r0, w0), (r1, w1) = run_distributed(_load_on_ranks, 2, args=(str(tmp_path),), timeout=120)
    seed_rng(derived_seed(1, 4, 1))
    assert r0 == want0 and r1 == torch.rand(1).item() and w0 == w1


@pytest.mark.multiprocess
def test_clear_megatron_style_shards_refused_on_another_world_size(tmp_path):
    from verl.testing.distributed import run_distributed
    run_distributed(_save_on_ranks, 2, args=(str(tmp_path), True), timeout=120)
    mgr = CheckpointManager(tmp_path, Placement())
    with pytest.raises(VerlConfigError, match=r"it was written by 2 processes and this run has 1: the engines of "
                                              r"actor save each rank's shard .*cannot be resharded; resume with 2 "
                                              r"processes"):
        mgr.load(mgr.resolve(str(tmp_path / "step_000004")), {"m": (torch.nn.Linear(4, 4), None)},
                 {"actor": _RankKeyed(0)})


def _train_on_ranks(rank: int, world_size: int, out: str, args: list[str]) -> None:
    import contextlib
    import io
    from verl.trainer.main_ppo import main
    with contextlib.redirect_stdout(io.StringIO()):
        main([*args, f"trainer.output_dir={out}"])


@pytest.mark.multiprocess
def test_behaves_trainer_resumes_a_two_process_run_on_one(tmp_path):
    """The audit's case: a 2-rank checkpoint resumed by 1 process resumed silently, dropping rank 1's RNG state."""
    from verl.testing.distributed import run_distributed
    from verl.trainer.main_ppo import main
    args = [*TINY, "warmup.steps=0", "trainer.export_hf=false", "trainer.plot=false", "actor.mini_batch_size=2",
            "actor.micro_batch_size=4", "reward.name=tests.trainer.test_multiprocess:length_reward"]
    run_distributed(_train_on_ranks, 2, args=(str(tmp_path), [*args, "trainer.total_steps=2"]), timeout=300)
    assert read_manifest(_step(tmp_path, 2))["world_size"] == 2
    with pytest.warns(UserWarning, match=r"step_000002, written by 2 processes, on 1: DCP reshards the model and "
                                         r"optimizer states by name; RNG: ranks 0..0 restore their own saved states, "
                                         r"the saved states of ranks 1..1 are unused"):
        main([*args, "trainer.total_steps=3", "trainer.resume=auto", f"trainer.output_dir={tmp_path}"])
    view = metrics_view(read_metrics(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in view if "reward/mean" in r] == [1, 2, 3]
    assert read_manifest(_step(tmp_path, 3))["world_size"] == 1
