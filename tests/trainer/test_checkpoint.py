"""Checkpoints: a resumed run's metrics equal the uninterrupted run's; a crash mid-save leaves no partial
checkpoint and resume=auto continues from the previous one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl.errors import VerlConfigError
from verl.rewards import register_reward
from verl.trainer.main_ppo import main
from verl.utils import checkpoint as ckpt_mod

VOLATILE = ("perf/", "timing/", "resumed_from_step")


def _steps(out_dir: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in recs if "reward/mean" in r}


def _samples(out_dir: Path) -> dict[int, list[int]]:
    from verl.utils.metrics import metrics_view, read_metrics
    rows = metrics_view(read_metrics(out_dir / "samples.jsonl"))
    return {r["step"]: r["data_indices"] for r in rows if "data_indices" in r}


def _length_reward(response, ground_truth, prompt):
    return float(len(response))


@pytest.mark.parametrize("extra", [
    ["algorithm.adv_estimator=grpo"],
    ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
     "actor.optim.warmup_steps=3"],
])
def test_resume_equals_uninterrupted(tmp_path, tiny_args, extra):
    # a dense reward (response length) so every step really moves the weights
    register_reward("test_length_ckpt")(_length_reward)
    common = [*extra, "trainer.export_hf=false", "trainer.plot=false", "actor.optim.lr=1e-2",
              "reward.name=test_length_ckpt"]
    main(tiny_args(*common, "trainer.total_steps=4", out="full"))
    main(tiny_args(*common, "trainer.total_steps=2", out="part"))
    main(tiny_args(*common, "trainer.total_steps=4", "trainer.resume=auto", out="part"))
    full, part = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert sorted(part) == [1, 2, 3, 4]
    assert part == full  # bit-exact: same weights, optimizer, RNG, data position and KL coefficient
    # the same dataset rows at each step: none skipped or repeated across the resume (samples.jsonl)
    assert _samples(tmp_path / "part") == _samples(tmp_path / "full")
    assert all(full[s]["actor/grad_norm"] > 0 for s in full)
    assert full[3]["actor/entropy"] != full[4]["actor/entropy"]


def test_crash_mid_save_is_atomic(tmp_path, tiny_args, monkeypatch):
    args = ["trainer.export_hf=false", "trainer.plot=false", "trainer.save_every=1"]
    main(tiny_args(*args, "trainer.total_steps=1"))
    root = tmp_path / "run" / "checkpoints"
    real_write = ckpt_mod._write_json

    def crash(path, obj):
        if path.name == "trainer_state.json":
            raise OSError("disk full (simulated)")
        return real_write(path, obj)

    monkeypatch.setattr(ckpt_mod, "_write_json", crash)
    with pytest.raises(OSError, match="simulated"):
        main(tiny_args(*args, "trainer.total_steps=2", "trainer.resume=auto"))
    monkeypatch.undo()
    assert [p.name for p in sorted(root.iterdir()) if not p.name.startswith(".")] == ["latest", "step_000001"]
    assert (root / "latest").read_text().strip() == "step_000001"
    main(tiny_args(*args, "trainer.total_steps=2", "trainer.resume=auto"))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]  # temp dir cleaned


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path, tiny_args):
    with pytest.raises(VerlConfigError, match="not a complete verl checkpoint"):
        main(tiny_args(f"trainer.resume={tmp_path}"))
