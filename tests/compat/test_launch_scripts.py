"""Upstream verl's launch scripts run here unchanged: `bash SCRIPT.sh <CI-sized overrides>` (their "$@"), with
`python3` this environment's interpreter, $HOME holding a few rows in verl's parquet layout (tests/compat/verl_data.py)
and the embedded tiny model in place of the hub model (the one substitution: `model.path=null`).

The scripts are kept byte-for-byte in tests/compat/verl_upstream/scripts/ (source and commit in their headers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.verl_data import make_home

ROOT = Path(__file__).parents[2]
SCRIPTS = Path(__file__).parent / "verl_upstream" / "scripts"

SUBSTITUTION = ["actor_rollout_ref.model.path=null", "critic.model.path=null"]
"""The embedded tiny model instead of the hub model (the critic starts from the policy, so it follows)."""

CI_SIZE = ["+actor_rollout_ref.model.override_config.max_position_embeddings=512", "data.train_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "critic.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=256",
           "data.max_response_length=8", "actor_rollout_ref.rollout.name=torch",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
           "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=-1"]
"""verl keys only: a CPU-sized batch, the local torch rollout engine, one process, two steps, one validation after
them (besides verl's default one before the first step)."""

MEGATRON_CPU = ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.dtype=float32", "actor_rollout_ref.ref.megatron.dtype=float32",
                "critic.megatron.dtype=float32"]
"""Megatron scripts on one CPU process: no model parallelism, float32."""

RUNS = {  # script -> (the algorithm it trains, the data sources it validates on, extra CI overrides)
    "grpo_trainer__run_qwen2-7b": ("grpo", ["openai/gsm8k"], []),
    "ppo_trainer__run_deepseek7b_llm": ("gae", ["openai/gsm8k"], []),
    "rloo_trainer__run_qwen2-7b": ("rloo", ["openai/gsm8k"], []),
    "reinforce_plus_plus_trainer__run_qwen2-7b_math_rf": (
        "reinforce_plus_plus", ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"], []),
    "gmpo_trainer__run_qwen2_5-7b_math": ("grpo", ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"], []),
    "grpo_trainer__run_qwen2-7b_math_megatron": (
        "grpo", ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"], MEGATRON_CPU),
    "ppo_trainer__run_deepseek_math_gsm8k_megatron": (
        "gae", ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"], MEGATRON_CPU),
}


def run_script(name: str, home: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """bash SCRIPT.sh EXTRA..., as a user would, with python3 / $HOME pointing here."""
    bin_dir = home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(["bash", str(SCRIPTS / f"{name}.sh"), *extra], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=home)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return make_home(tmp_path_factory.mktemp("home"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_upstream_script_runs_unchanged(home, tmp_path, name):
    algo, sources, extra = RUNS[name]
    out = tmp_path / "run"
    proc = run_script(name, home, *SUBSTITUTION, *CI_SIZE, *extra, f"trainer.default_local_dir={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["actor/grad_norm"] >= 0 for r in steps)
    assert ("critic/vf_loss" in steps[0]) == (algo == "gae")
    vals = [r for r in rows if "val/reward_mean" in r]
    assert [r["step"] for r in vals] == [0, 2]  # verl's val_before_train, and test_freq=2 / the last step
    for source in sources:
        assert f"val/{source}/reward_mean" in vals[-1]
    assert f"done: 2 steps" in proc.stdout


@pytest.mark.slow
def test_a_refused_key_stops_the_script_before_anything_runs(home, tmp_path):
    out = tmp_path / "run"
    proc = run_script("grpo_trainer__run_qwen2-7b", home, *SUBSTITUTION, *CI_SIZE,
                      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", f"trainer.default_local_dir={out}")
    assert proc.returncode == 2
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: Ulysses sequence parallelism" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_n_gpus_per_node_starts_that_many_processes(home, tmp_path):
    """A plain `python3 -m verl.trainer.main_ppo ... trainer.n_gpus_per_node=2` starts the two ranks itself."""
    out = tmp_path / "run"
    size = [o for o in CI_SIZE if not o.startswith("trainer.n_gpus_per_node")]
    proc = run_script("grpo_trainer__run_qwen2-7b", home, *SUBSTITUTION, *size, "trainer.n_gpus_per_node=2",
                      "trainer.total_training_steps=1", f"trainer.default_local_dir={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting 2 processes" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
