"""The LoRA and delta-sync variants of the real-model job, CI-sized (the settings of test_smollm2_example.py):
examples/smollm2_gsm8k_lora.yaml (a rank-16 adapter on every linear layer of SmolLM2-135M-Instruct) exports a PEFT
adapter of 3.6% of the model; examples/smollm2_gsm8k_delta.yaml (a bfloat16 generation copy, rollout.sync=delta)
moves a fraction of the full sync's bytes per step after the first."""

from __future__ import annotations

import json
import math
from pathlib import Path

from verl.trainer.main_ppo import main

from tests.trainer.test_smollm2_example import CI_SIZED

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_the_lora_example_trains_the_adapter_and_exports_it(tmp_path, smollm2_dir):
    ci = [o for o in CI_SIZED if o != "trainer.export_hf=false"]
    assert main([str(EXAMPLES / "smollm2_gsm8k_lora.yaml"), *ci, f"trainer.output_dir={tmp_path}"]) == 0
    steps = _steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in steps)
    adapter = (tmp_path / "hf_actor" / "adapter_model.safetensors").stat().st_size
    config = json.loads((tmp_path / "hf_actor" / "adapter_config.json").read_text())
    assert config["r"] == 16 and 0.03 < adapter / (134.5e6 * 4) < 0.04


def test_the_delta_example_moves_a_fraction_of_the_full_sync(tmp_path, smollm2_dir):
    assert main([str(EXAMPLES / "smollm2_gsm8k_delta.yaml"), *CI_SIZED, f"trainer.output_dir={tmp_path}"]) == 0
    steps = _steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["perf/sync_full"] == 0.0 and r["perf/sync_bucket_resyncs"] == r["perf/sync_verify_failures"] == 0
        assert 0 < r["perf/sync_changed_frac"] < 0.5
        assert r["perf/sync_bytes"] < r["perf/sync_full_bytes"] / 2 and r["perf/full_sync_s"] > 0
        print(f"step {r['step']}: changed {r['perf/sync_changed_frac']:.4f}, {r['perf/sync_bytes'] / 1e6:.1f} MB of "
              f"{r['perf/sync_full_bytes'] / 1e6:.1f}, {r['perf/sync_s']:.2f} s vs full {r['perf/full_sync_s']:.2f} s")
