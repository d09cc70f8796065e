"""Two gloo ranks: data-parallel GRPO keeps the replicas identical, splits the prompts, and checkpoints /
resumes with every rank's RNG."""

from __future__ import annotations

import json

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.testing import run_distributed
from verl.trainer.ppo_trainer import PPOTrainer
from verl.distributed import init_placement

from tests.trainer.conftest import TINY


def length_reward(response: str, ground_truth: str, prompt: str) -> float:
    """Dense reward so that every step moves the weights."""
    return float(len(response))


def _fit(overrides):
    trainer = PPOTrainer(load_config(PPOConfig, None, overrides), init_placement("cpu"))
    history = trainer.fit()
    params = torch.cat([p.detach().reshape(-1) for p in trainer.actor.engine.module.parameters()])
    return params, history


def _train(rank, world_size, base, root):
    full, full_hist = _fit([*base, f"trainer.output_dir={root}/full", "trainer.total_steps=3"])
    _fit([*base, f"trainer.output_dir={root}/part", "trainer.total_steps=2"])
    resumed, _ = _fit([*base, f"trainer.output_dir={root}/part", "trainer.total_steps=3", "trainer.resume=auto"])
    return {"full": full, "resumed": resumed, "reward": full_hist[-1]["reward/mean"]}


@pytest.mark.multiprocess
def test_two_ranks_stay_in_sync_and_resume(tmp_path):
    base = [*TINY, "reward.name=tests.trainer.test_multiprocess:length_reward", "trainer.export_hf=false",
            "trainer.plot=false", "actor.optim.lr=1e-2", "actor.mini_batch_size=2", "actor.micro_batch_size=4"]
    r0, r1 = run_distributed(_train, 2, args=(base, str(tmp_path)), timeout=300)
    assert torch.equal(r0["full"], r1["full"])           # replicas identical after data-parallel updates
    assert r0["reward"] == r1["reward"]                    # metrics are all-reduced
    assert torch.equal(r0["resumed"], r0["full"]) and torch.equal(r1["resumed"], r1["full"])
    metrics = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == [1, 2, 3]


def _default_job(rank, world_size, root):
    """The default job's config, as `verl train` runs it, shortened to two steps (batch sizes untouched)."""
    import contextlib
    import io
    from verl.trainer.main_ppo import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["warmup.steps=2", "trainer.total_steps=2", "data.num_examples=64", "trainer.save_final=false",
              "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.tensorboard=false",
              "trainer.progress_bar=false", "trainer.device=cpu", f"trainer.output_dir={root}"])
    return out.getvalue()


@pytest.mark.multiprocess
def test_default_job_runs_on_two_ranks(tmp_path):
    """actor.micro_batch_size=256 of the default job is more than a rank's 128 responses under 2 processes:
    clamped, said once (by rank 0), and the job runs."""
    out0, out1 = run_distributed(_default_job, 2, args=(str(tmp_path),), timeout=600)
    note = "verl: actor.micro_batch_size=256 is more than the 128 responses each of 2 data-parallel ranks gets"
    assert out0.count(note) == 1 and note not in out1
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["actor/nonfinite_steps"] == 0.0 for r in steps)
