"""Every `rollout.engine` x `trainer.mode` x training engine (`actor.engine`) that the docs name, each through
`verl train`'s own entry point (verl.trainer.main_ppo.main): a short run (2 steps of a 1-layer model) where the
docs say the combination trains, and the refusal they promise where they rule it out, raised before any model
is built (the checks PPOTrainer runs first: whether the engine can run here, then the world's placement).

What the docs rule out (docs/training.md "Generation", docs/placement.md "The rollout on its own ranks",
docs/async.md):
- sglang is GPU only: refused here, naming what to install;
- one_step_off and async need the rollout on ranks of its own, which a megatron actor cannot feed.
sync runs on 1 process; one_step_off and async on 2 (actor rank 0, rollout rank 1). The vllm row runs where
vLLM is installed (scripts/vllm_check.sh runs it with `-m vllm`); elsewhere it is skipped, as every vLLM test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from verl.config import PPOConfig, TrainerConfig, load_config
from verl.engines import engines, rollout_engine, training_engine
from verl.errors import VerlConfigError
from verl.rollout import engine_available
from verl.testing import run_distributed

from tests.trainer.conftest import TINY

MODES = typing.get_args(typing.get_type_hints(TrainerConfig)["mode"])
TRAINING = engines("training")
RUN = [*TINY, "warmup.steps=0", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false"]
OWN_RANKS = ["trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]", "reward.ranks=[0]"]
# vLLM's CPU attention needs a head size of at least 32
VLLM_SHAPE = ["model.tiny.hidden_size=128", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
              "model.tiny.intermediate_size=256"]
_vllm_ok, _vllm_why = engine_available("vllm")


def refusal(rollout: str, mode: str, training: str) -> str | None:
    """The documented refusal of a combination (a pattern of its message), or None where it must train. The
    capabilities come from the engine table (verl.engines), which the docs describe."""
    if rollout != "vllm" and not engine_available(rollout)[0]:  # sglang off a GPU (vllm: its own environment)
        return f"rollout.engine={rollout} cannot run here"
    if mode != "sync" and not training_engine(training).sends_to_own_ranks:
        return f"with the {training} actor, whose weights cannot reach a rollout on ranks of its own"
    return None


def overrides(rollout: str, mode: str, training: str) -> list[str]:
    extra = [f"rollout.engine={rollout}", f"trainer.mode={mode}", f"actor.engine={training}"]
    if mode != "sync":  # a megatron actor spans every rank; its rollout on ranks of their own is the refusal
        extra += OWN_RANKS + (["actor.ranks=[0,1]", "critic.ranks=[0,1]"] if training == "megatron" else [])
    if rollout == "vllm":
        extra += VLLM_SHAPE
        if mode != "sync":  # on ranks of its own vLLM runs in a process of its own (see verl.distributed.roles)
            extra += ["rollout.in_process=false"]
    return extra


def _cells():
    # verl's own engines: a test may register one of its own (tests/rollout/test_engine_table.py's toy), which the
    # processes this matrix spawns do not have
    for rollout in [n for n in engines("rollout") if rollout_engine(n).factory.startswith("verl.")]:
        for mode in MODES:
            for training in TRAINING:
                marks = [pytest.mark.multiprocess]
                if rollout == "vllm":
                    marks += [pytest.mark.vllm, pytest.mark.skipif(not _vllm_ok, reason=_vllm_why or "no vllm")]
                yield pytest.param(rollout, mode, training, marks=marks, id=f"{rollout}-{mode}-{training}")


def _steps(argv: list[str]) -> list[dict]:
    out = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("trainer.output_dir=")))
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def _train(rank: int, world_size: int, argv: list[str]) -> list[dict]:
    from verl.trainer.main_ppo import main
    assert main(argv) == 0
    return _steps(argv) if rank == 0 else []


def _launch(argv: list[str], world: int) -> list[dict]:
    """The run's step metrics: spawned gloo ranks, or torchrun where the engine starts processes of its own
    (which the spawned ranks, being daemons, may not)."""
    if "rollout.in_process=false" not in argv:
        spawn = any(a.startswith("rollout.engine=") and a.split("=")[1] in ("vllm", "sglang") for a in argv)
        return run_distributed(_train, world, args=(argv,), timeout=600, spawn=spawn)[0]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), f"--nproc_per_node={world}", "-m", "verl.trainer.main_ppo", *argv],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _steps(argv)


@pytest.mark.parametrize("rollout, mode, training", list(_cells()))
def test_every_engine_mode_and_training_engine(tmp_path, rollout, mode, training):
    argv = [*RUN, *overrides(rollout, mode, training), f"trainer.output_dir={tmp_path / 'run'}"]
    world = 1 if mode == "sync" else 2
    why = refusal(rollout, mode, training)
    if why is not None:
        cfg = load_config(PPOConfig, None, argv)
        with pytest.raises(VerlConfigError, match=why):  # what PPOTrainer checks first, in its order
            cfg.engine_specs()["rollout"].require("rollout.engine")
            cfg.validate_world(world)
        assert not (tmp_path / "run").exists()
        return
    steps = _launch(argv, world)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert 0.0 <= r["reward/mean"] <= 1.0
    staleness = [r.get("rollout/staleness_max", 0.0) for r in steps]
    # one_step_off trains batch k (k >= 2) on the weights after update k - 1: one version stale; async at most
    # algorithm.max_staleness (1 by default); sync never
    assert staleness == ([0.0, 1.0] if mode == "one_step_off" else [0.0, 0.0] if mode == "sync" else staleness)
    assert max(staleness) <= 1.0
