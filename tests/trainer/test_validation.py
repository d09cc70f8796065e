"""Validation (verl.trainer.validation): held-out prompts answered by the rollout engine with the current weights,
scored by the job's reward, reported in the JSONL, TensorBoard, the progress bar and curves.png."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.config import PPOConfig, load_config
from verl.errors import VerlConfigError
from verl.trainer.main_ppo import main
from verl.trainer.validation import pass_at_k, validation_due

ROOT = Path(__file__).parents[2]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2) / C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0


def test_when_validation_runs():
    cfg = load_config(PPOConfig, None, ["trainer.test_freq=3", "trainer.total_steps=7"])
    assert [s for s in range(1, 8) if validation_due(cfg, s)] == [3, 6, 7]  # and after the last step
    cfg = load_config(PPOConfig, None, ["trainer.test_freq=0"])
    assert not any(validation_due(cfg, s) for s in range(1, 60))


def test_sampled_validation_reports_pass_at_k_everywhere(tmp_path, tiny_args):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    args = tiny_args("val.num_examples=6", "val.n=4", "val.temperature=1.0", "trainer.test_freq=1",
                     "val.log_generations=2", "trainer.tensorboard=true", "trainer.plot=true")
    assert main(args) == 0
    out = tmp_path / "run"
    vals = [r for r in rows(out) if "val/reward_mean" in r]
    assert [r["step"] for r in vals] == [0, 1, 2]
    for key in ("val/pass@1", "val/pass@2", "val/pass@4", "val/mean@4", "val/arithmetic/reward_mean",
                "val/response_length", "timing/validation_s"):
        assert key in vals[-1], key
    assert vals[-1]["val/pass@1"] <= vals[-1]["val/pass@2"] <= vals[-1]["val/pass@4"]
    assert vals[-1]["val/mean@4"] == vals[-1]["val/reward_mean"]
    logged = [json.loads(x) for x in (out / "val_generations.jsonl").read_text().splitlines()]
    assert {(g["step"], g["row"]) for g in logged} == {(s, r) for s in (0, 1, 2) for r in (0, 1)}
    assert len(logged) == 3 * 2 * 4 and all(g["data_source"] == "arithmetic" for g in logged)
    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("val/pass@1")] == [0, 1, 2]
    assert (out / "curves.png").stat().st_size > 0


def test_greedy_validation_is_reproducible_and_val_only_trains_nothing(tmp_path, tiny_args):
    for out in ("a", "b"):
        assert main(tiny_args("val.num_examples=8", "trainer.val_only=true", out=out)) == 0
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert not any("reward/mean" in r for r in a) and not (tmp_path / "a" / "hf_actor").exists()
    strip = (lambda r: {k: v for k, v in r.items() if not k.startswith("timing/") and not k.startswith("warmup/")})
    assert strip(a[0]) == strip(b[0]) and "val/pass@1" in a[0]


def test_validation_only_in_sync_mode():
    with pytest.raises(VerlConfigError, match=r"validation .* runs in trainer.mode=sync"):
        load_config(PPOConfig, None, ["val.num_examples=8", "trainer.mode=one_step_off"])
    with pytest.raises(VerlConfigError, match=r"val.n.*needs val.temperature > 0"):
        load_config(PPOConfig, None, ["val.n=4"])


@pytest.mark.slow
def test_two_ranks_validate_like_one(tmp_path, tiny_args):
    """The held-out set is split over the ranks and gathered back: greedy metrics equal a one-process run."""
    args = tiny_args("val.num_examples=7", "trainer.val_only=true", out="one")  # 7 rows: one rank gets a copy
    assert main(args) == 0
    two = [a.replace(str(tmp_path / "one"), str(tmp_path / "two")) for a in args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "verl.trainer.main_ppo", *two], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pick = (lambda r: {k: v for k, v in r.items() if k.startswith("val/")})
    assert pick(rows(tmp_path / "one")[0]) == pick(rows(tmp_path / "two")[0])
