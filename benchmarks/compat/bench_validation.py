"""The default job's validation: held-out accuracy before and after training, and what validating costs.

Runs the default job (verl/trainer/config/default.yaml as it is: a 300-step warm start, 200 GRPO steps, 32 held-out
arithmetic problems validated greedily before the first step, every trainer.test_freq=20 steps and after the last)
and reads its metrics.jsonl: val/pass@1 (the held-out accuracy) at step 0 and at the last step, and the cost of
validation measured in the same run: the summed timing/validation_s of every validation over the summed
perf/step_time_s of the RL steps (which exclude validation), also over the run's whole wall time.

    python benchmarks/compat/bench_validation.py                   # or: verl bench compat
    python benchmarks/compat/bench_validation.py --steps 40        # shorter (the results file says so)

Writes benchmarks/results/validation_default_job[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run(overrides: list[str]) -> tuple[list[dict], float]:
    from verl.trainer.main_ppo import main
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        rc = main([*overrides, f"trainer.output_dir={out}", "trainer.progress_bar=false", "trainer.save_every=0",
                   "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false"])
        if rc:
            raise SystemExit(f"the default job failed (exit {rc})")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - t0


def summarise(rows: list[dict], wall: float) -> dict:
    vals = [r for r in rows if "val/pass@1" in r]
    steps = [r for r in rows if "perf/step_time_s" in r]
    val_s = sum(r["timing/validation_s"] for r in vals)
    rl_s = sum(r["perf/step_time_s"] for r in steps)
    first, last = vals[0], vals[-1]
    return {
        "held_out_accuracy_before": first["val/pass@1"], "held_out_accuracy_after": last["val/pass@1"],
        "validated_at_steps": [r["step"] for r in vals],
        "held_out_accuracy_curve": {str(r["step"]): r["val/pass@1"] for r in vals},
        "train_reward_first10": sum(r["reward/mean"] for r in steps[:10]) / min(10, len(steps)),
        "train_reward_last10": sum(r["reward/mean"] for r in steps[-10:]) / min(10, len(steps)),
        "validation_s": val_s, "rl_steps_s": rl_s, "wall_s": wall,
        "validation_over_rl_steps": val_s / rl_s, "validation_over_wall": val_s / wall,
        "validations": len(vals), "rl_steps": len(steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the default job's 200)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    from verl.utils.results import RunInfo, write_result
    given = sys.argv[1:] if argv is None else argv
    run_info = RunInfo.start(command=" ".join(["python benchmarks/compat/bench_validation.py", *given]))
    overrides = [f"trainer.seed={args.seed}"] + ([f"trainer.total_steps={args.steps}"] if args.steps else [])
    rows, wall = run(overrides)
    result = summarise(rows, wall)
    meta = {"config": "verl/trainer/config/default.yaml", "overrides": overrides,
            "note": "validation_over_rl_steps: the time of every validation (greedy, 32 held-out prompts, before "
                    "the first step, every 20 steps and after the last) over the time of the RL steps, in the same "
                    "run; the warm start is in wall_s only. Held-out accuracy: val/pass@1, the share of held-out "
                    "problems answered exactly (greedy)."}
    name = "validation_default_job" + (f"_{args.tag}" if args.tag else "")
    path = Path(args.out) / f"{name}.json"
    write_result(path, {"result": result}, run_info, **meta)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
