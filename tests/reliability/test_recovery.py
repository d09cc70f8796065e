"""Elastic recovery (trainer.recovery, verl.utils.snapshot): the per-rank snapshot store, and the default job under
`torchrun --max-restarts` with a worker SIGKILLed mid-run, which must end exactly where the uninterrupted run
ends (weights bit for bit, the metrics series timings aside, every data index trained once), and two torchrun
agents (--nnodes=1:2) of which one node is lost for good: the job goes on with the node left."""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from verl.errors import VerlConfigError
from verl.utils import snapshot as snap
from verl.utils.metrics import metrics_view, read_metrics

ROOT = Path(__file__).resolve().parents[2]
VOLATILE = ("perf/", "timing/", "recovery/", "resumed_from_step")


def _store(root: Path, *, rank: int = 0, world: int = 1, digest: str = "abc", fallback: Path | None = None):
    return snap.Snapshots(root, fallback or root, "run1", rank, world, digest)


def _state(v: float) -> dict:
    return {"actor": {"model": {"w": torch.full((3,), v)}, "optim": {"state": {"w": {"step": torch.tensor(v)}},
                                                                      "param_groups": [{"lr": 0.1}]}}}


def test_behaves_snapshots_keep_the_two_newest_and_restore_in_place(tmp_path):
    store = _store(tmp_path)
    for step in range(1, 5):
        store.save(step, _state(float(step)), {"step": step}, {"rng": step})
    store.wait()
    assert sorted(store.available()) == [3, 4]
    assert store.common_steps(distributed=False) == [4, 3]
    more = snap.Snapshots(tmp_path / "more", tmp_path / "more", "run1", 0, 1, "abc", keep=3)  # async actor ranks
    for step in range(1, 6):
        more.save(step, {}, {"step": step}, {})
    more.wait()
    assert more.common_steps(distributed=False) == [5, 4, 3]
    with pytest.raises(VerlConfigError, match="1 to 8 snapshots, not 9"):
        snap.Snapshots(tmp_path, tmp_path, "run1", 0, 1, "abc", keep=9)
    payload = store.load(4)
    assert payload["trainer"] == {"step": 4} and payload["rng"] == {"rng": 4}
    target = _state(0.0)
    live = target["actor"]["model"]["w"]
    snap.fill(target, payload["tensors"])
    assert target["actor"]["model"]["w"] is live and torch.equal(live, torch.full((3,), 4.0))  # copied in place
    store.clear()
    assert not (tmp_path / "run1").exists()


def test_behaves_the_snapshot_is_a_copy_taken_at_the_step(tmp_path):
    store = _store(tmp_path)
    state = _state(1.0)
    store.save(1, state, {"step": 1}, {})
    state["actor"]["model"]["w"].fill_(9.0)  # the next step changes the live tensors while the writer runs
    store.wait()
    assert torch.equal(store.load(1)["tensors"]["actor"]["model"]["w"], torch.full((3,), 1.0))


def test_clear_full_memory_sends_snapshots_to_disk_with_a_warning(tmp_path, monkeypatch, capsys):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    real = torch.save

    def save(obj, path, *a, **kw):
        if str(path).startswith(str(shm)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **kw)
    monkeypatch.setattr(snap.torch, "save", save)
    store = _store(shm, fallback=disk)
    store.save(1, _state(1.0), {"step": 1}, {})
    store.wait()
    out = capsys.readouterr().out
    assert f"{shm} is full (No space left on device)" in out and str(disk) in out
    assert sorted(store.available()) == [1] and str(store.available()[1]).startswith(str(disk))
    assert not store.disabled


def test_clear_a_failing_writer_turns_snapshots_off_with_a_warning(tmp_path, monkeypatch):
    def save(obj, path, *a, **kw):
        raise OSError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(snap.torch, "save", save)
    store = _store(tmp_path)
    store.save(1, _state(1.0), {"step": 1}, {})
    with pytest.warns(UserWarning, match=r"could not write its snapshot .*Permission denied.*newest checkpoint"):
        store.save(2, _state(2.0), {"step": 2}, {})
    assert store.disabled and store.available() == {}


def test_clear_snapshots_of_another_config_or_world_size_are_not_used(tmp_path):
    _store(tmp_path, digest="aaa").save(1, _state(1.0), {"step": 1}, {})
    _store(tmp_path, digest="bbb", world=2).save(1, _state(1.0), {"step": 1}, {})
    time.sleep(0.5)
    other = _store(tmp_path, digest="bbb")
    assert other.available() == {}
    assert sorted(other.others()) == ["2 processes", "another config"]


def test_clear_a_snapshot_of_another_rank_is_refused(tmp_path):
    store = _store(tmp_path)
    store.save(1, _state(1.0), {"step": 1}, {})
    store.wait()
    theirs = _store(tmp_path, rank=1)
    theirs.dir(tmp_path).mkdir(parents=True)
    os.link(store.available()[1], theirs.dir(tmp_path) / "step_000001.pt")
    with pytest.raises(VerlConfigError, match=r"not this rank's state of step 1: \{'rank': 0\}"):
        theirs.load(1)


def test_clear_fill_names_a_value_of_another_shape():
    with pytest.raises(VerlConfigError, match=r"snapshot value /actor/model/w is \(2,\), this rank holds \(3,\)"):
        snap.fill(_state(0.0), {"actor": {"model": {"w": torch.zeros(2)}, "optim": _state(0.0)["actor"]["optim"]}})


def test_behaves_recovery_follows_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert not snap.recovery_enabled("auto") and snap.recovery_enabled("on") and not snap.recovery_enabled("off")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert snap.recovery_enabled("auto") and snap.torchrun_restarts() == (1, 3)
    assert abs(snap.process_start_time() - time.time()) < 24 * 3600


# -- the default job, killed under torchrun --------------------------------------------------------------------
TINY_JOB = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "data.num_examples=72",
            "data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.mini_batch_size=8",
            "actor.micro_batch_size=16", "warmup.steps=5", "warmup.batch_size=8", "trainer.total_steps=12",
            "trainer.save_every=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.plot=false", "trainer.threads=1", "val.num_examples=8", "trainer.test_freq=4",
            "actor.optim.lr=1e-2"]
SPLIT = ["trainer.mode=one_step_off", "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
         "reward.ranks=[0]", "algorithm.rollout_correction.is_level=token", "val.num_examples=0"]


def _torchrun(out: Path, overrides: list[str], kill_after: int | None = None, victim: int = 1):
    """Runs the job on 2 processes under torchrun (2 restarts allowed); with `kill_after`, SIGKILLs worker
    `victim` (by start order) once that many steps are logged. Returns torchrun's output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=2",
           "--monitor-interval=0.1", "-m", "verl.trainer.main_ppo", *TINY_JOB, f"trainer.output_dir={out}",
           f"trainer.snapshot_dir={out.parent / 'shm'}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=out.parent, stdout=f, stderr=subprocess.STDOUT)
        killed = kill_after is None
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"HANG: {log.read_text()[-3000:]}")
            if not killed and (out / "metrics.jsonl").exists():
                done = sum('"reward/mean"' in line for line in (out / "metrics.jsonl").read_text().splitlines())
                kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                if done >= kill_after and len(kids) == 2:
                    os.kill(sorted(map(int, kids))[victim], signal.SIGKILL)
                    killed = True
            time.sleep(0.02)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    # the ranks' warm spares (verl.utils.spare) leave with torchrun's agent, their sockets with them
    spares = os.path.join(tempfile.gettempdir(), f"verl-spare-{proc.pid}-*.sock")
    deadline = time.monotonic() + 10
    while glob.glob(spares) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not glob.glob(spares)
    return text


def _series(out: Path, name: str) -> dict:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
            for r in metrics_view(read_metrics(out / name)) if "reward/mean" in r or "data_indices" in r}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode,victim,engine", [("sync", 1, "torch"), ("one_step_off", 0, "torch"),
                                                ("sync", 0, "fsdp"), ("sync", 1, "megatron")])
def test_behaves_a_killed_rank_is_recovered_exactly(tmp_path, mode, victim, engine):
    """The actor's engine's own state in the snapshot: a torch replica, FSDP2's DTensor shards (2 ranks), a
    megatron engine's model and optimizer (two data-parallel replicas at TP=1 here)."""
    from safetensors.torch import load_file
    extra = (SPLIT if mode == "one_step_off" else []) + [f"actor.engine={engine}"]
    _torchrun(tmp_path / "clean", extra)
    log = _torchrun(tmp_path / "killed", extra, kill_after=5, victim=victim)
    assert "torchrun restart 1 of at most 2: continuing from the snapshot of step" in log, log[-3000:]
    from verl.utils.spare import supported
    assert ("(the worker started in its rank's warm spare)" in log) == supported(), log[-3000:]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert _series(killed, "metrics.jsonl") == _series(clean, "metrics.jsonl")  # validations included
    samples = _series(killed, "samples.jsonl")
    assert samples == _series(clean, "samples.jsonl") and sorted(samples) == list(range(1, 13))
    # 72 training rows (the held-out prompts are generated apart), 8 per step: the first epoch's 9 steps train
    # every row exactly once, and the second epoch's first 3 steps none twice
    first = [i for s in range(1, 10) for i in samples[s]["data_indices"]]
    second = [i for s in range(10, 13) for i in samples[s]["data_indices"]]
    assert sorted(first) == list(range(72)) and len(set(second)) == len(second) == 24
    a, b = load_file(str(clean / "hf_actor" / "model.safetensors")), load_file(str(killed / "hf_actor" /
                                                                                    "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recs = read_metrics(killed / "metrics.jsonl")
    assert any("perf/snapshot_s" in r for r in recs) and any("recovery/ready_time" in r for r in recs)
    assert not any((tmp_path / "shm").rglob("*.pt"))  # the run ended: its snapshots are gone
    manifest = json.loads((killed / "verl_run.json").read_text())
    assert [e["event"] for e in manifest["history"]] == ["fresh", "resume"], manifest["history"]


ASYNC = ["trainer.mode=async", "trainer.async_versions=pinned", "algorithm.max_staleness=2", *SPLIT[1:],
         "trainer.save_every=3"]


# the rollout's rank killed with partial rollouts on a schedule: batch b's first 2 tokens with version b - 2, its
# last 2 with version b - 1 (every response 4 tokens long); the actor an FSDP2 engine (on its one rank)
PARTIAL = ["rollout.partial=true", "rollout.partial_switch_token=2", "rollout.ignore_eos=true", "actor.engine=fsdp"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim,partial", [(0, []), (1, PARTIAL)], ids=["actor", "rollout-partial-fsdp"])
def test_behaves_a_killed_async_run_is_recovered_exactly_from_its_snapshots(tmp_path, victim, partial):
    """trainer.mode=async (pinned versions, up to 2 ahead): the actor's rank snapshots its state after each step,
    the rollout's rank after each batch the state a restore at each step it fits needs (the sampler before that
    step's batch, the batches generated ahead of it, with their weight versions); the restarted workers continue
    from the newest step both hold, newer than the last checkpoint (step 3), the rollout's rank putting its
    queued batches back first. Killed: the actor's rank (0, a torch actor), or the rollout's (1, an FSDP2 actor)
    with partial rollouts whose tokens switch weight versions at a fixed token, so that the batch it was
    generating is made again exactly."""
    from safetensors.torch import load_file
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    _torchrun(clean, [*ASYNC, *partial])
    log = _torchrun(killed, [*ASYNC, *partial], kill_after=5, victim=victim)
    restored = re.search(r"torchrun restart 1 of at most 2: continuing from the snapshot of step (\d+)", log)
    assert restored is not None and int(restored.group(1)) >= 4, log[-3000:]
    assert "dropping" not in log
    timing = ("rollout/weight_wait_s",)
    drop = lambda series: {s: {k: v for k, v in r.items() if k not in timing} for s, r in series.items()}  # noqa
    assert drop(_series(killed, "metrics.jsonl")) == drop(_series(clean, "metrics.jsonl"))
    if partial:  # each token's version as scheduled: batches 0 and 1 on version 0 throughout
        series = [r for _, r in sorted(_series(clean, "metrics.jsonl").items())]
        assert [r["rollout/token_staleness_mean"] for r in series] == [0.0, 1.0] + [1.5] * 10
        assert [r["rollout/mixed_version_share"] for r in series] == [0.0, 0.0] + [1.0] * 10
    staleness = [r["rollout/staleness_max"] for _, r in sorted(_series(clean, "metrics.jsonl").items())]
    assert staleness == [0.0, 1.0] + [2.0] * 10
    samples = _series(killed, "samples.jsonl")
    assert samples == _series(clean, "samples.jsonl") and sorted(samples) == list(range(1, 13))
    first = [i for s in range(1, 10) for i in samples[s]["data_indices"]]
    assert sorted(first) == list(range(72))
    a, b = load_file(str(clean / "hf_actor" / "model.safetensors")), load_file(str(killed / "hf_actor" /
                                                                                    "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((killed / "verl_run.json").read_text())
    assert [e["event"] for e in manifest["history"]] == ["fresh", "resume"], manifest["history"]


def _setup_with_seed(rank, world_size, out):
    from verl.config.base import load_config
    from verl.config.ppo import PPOConfig
    from verl.distributed import init_placement
    from verl.trainer.ppo_trainer import PPOTrainer
    overrides = [*TINY_JOB, f"trainer.output_dir={out}", f"trainer.seed={1 + (rank == 1)}"]
    trainer = PPOTrainer(load_config(PPOConfig, None, overrides), init_placement("cpu"))
    try:
        trainer.setup()
    except VerlConfigError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_clear_ranks_with_different_configs_are_refused_before_step_1(tmp_path):
    from verl.testing import run_distributed
    errors = run_distributed(_setup_with_seed, 2, args=(str(tmp_path / "run"),), timeout=200)
    assert errors[0] == errors[1] and "ranks [1] loaded another config than rank 0" in errors[0], errors
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_clear_the_last_restart_says_that_none_is_left(monkeypatch, capsys):
    from verl.errors import VerlRuntimeError, run_cli
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("VERL_TRACEBACK", raising=False)

    def main(argv):
        raise VerlRuntimeError("rank 0 lost contact with ranks [1]")
    assert run_cli(main, [], prog="verl train") == 1
    err = capsys.readouterr().err
    assert "verl train: torchrun's restarts are used up (3 of --max-restarts=3;" in err
    assert "continue it with trainer.resume=auto" in err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarts left: torchrun goes on, nothing said
    run_cli(main, [], prog="verl train")
    assert "used up" not in capsys.readouterr().err


def test_behaves_a_new_session_removes_what_a_failed_one_left(tmp_path):
    _store(tmp_path, digest="old", world=2, rank=1).save(3, _state(1.0), {"step": 3}, {})
    theirs = _store(tmp_path, digest="old", world=2, rank=0)
    theirs.save(3, _state(1.0), {"step": 3}, {})
    theirs.wait()
    time.sleep(0.3)
    mine = _store(tmp_path, digest="new", world=2, rank=1)
    mine.clear_stale(["run1"])
    assert not (tmp_path / "run1" / "old-w2" / "rank_00001").exists()
    assert (tmp_path / "run1" / "old-w2" / "rank_00000" / "step_000003.pt").exists()  # another rank's: its own


# -- a node lost for good: torchrun --nnodes=1:2 goes on with the one left --------------------------------------
def _descendants(pid: int) -> list[int]:
    kids = [int(k) for k in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return kids + [d for k in kids for d in _descendants(k)]


@pytest.mark.multiprocess
def test_behaves_a_lost_node_shrinks_the_job_to_the_nodes_left(tmp_path):
    """Two torchrun agents (two nodes, one process each) with --nnodes=1:2. Node B (its agent and every process
    under it) is SIGKILLed mid-run and never comes back: node A's worker fails on the dead peer, its agent meets
    the rendezvous again with the one node left, and the restarted worker continues alone from the newest
    checkpoint, resharded from 2 processes to 1 (the 2-process snapshots are refused), to the last step, every
    data index of the first epoch trained exactly once across the two world sizes."""
    from verl.distributed.placement import free_port
    port, out = free_port(), tmp_path / "run"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=2",
             "--monitor-interval=0.1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
             f"--rdzv_id=verl-shrink-{port}", "--rdzv_conf=last_call_timeout=5", "-m", "verl.trainer.main_ppo",
             *TINY_JOB, "trainer.save_every=2", f"trainer.output_dir={out}",
             f"trainer.snapshot_dir={tmp_path / 'shm'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    logs = [tmp_path / "node_a.log", tmp_path / "node_b.log"]
    with logs[0].open("w") as fa, logs[1].open("w") as fb:
        a = subprocess.Popen(agent, env=env, cwd=tmp_path, stdout=fa, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # node A hosts the rendezvous store (the first agent at the endpoint does)
        b = subprocess.Popen(agent, env=env, cwd=tmp_path, stdout=fb, stderr=subprocess.STDOUT)
        deadline, killed = time.monotonic() + 300, False
        try:
            while a.poll() is None:
                assert time.monotonic() < deadline, f"HANG: {logs[0].read_text()[-3000:]}"
                if not killed and (out / "metrics.jsonl").exists():
                    done = sum('"reward/mean"' in ln for ln in (out / "metrics.jsonl").read_text().splitlines())
                    if done >= 5:
                        for pid in [b.pid, *_descendants(b.pid)]:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        killed = True
                time.sleep(0.02)
        finally:
            for p in (a, b):
                if p.poll() is None:
                    p.kill()
    text = logs[0].read_text()
    assert killed and a.returncode == 0, text[-4000:]
    assert "snapshots taken with 2 processes are not used" in text, text[-4000:]
    assert "torchrun restart 1 of at most 2: continuing from " in text and "checkpoints/step_0000" in text, text[-4000:]
    samples = _series(out, "samples.jsonl")
    assert sorted(samples) == list(range(1, 13)) and sorted(_series(out, "metrics.jsonl")) == list(range(1, 13))
    first = [i for s in range(1, 10) for i in samples[s]["data_indices"]]
    assert sorted(first) == list(range(72)), "each index of the first epoch once, across both world sizes"
    resumed = [r for r in read_metrics(out / "metrics.jsonl") if "resumed_from_step" in r]
    assert len(resumed) == 1 and resumed[0]["resumed_from_step"] >= 4 and resumed[0]["resumed_from_step"] % 2 == 0
    manifest = json.loads((out / "verl_run.json").read_text())
    assert [e["event"] for e in manifest["history"]] == ["fresh", "resume"], manifest["history"]
