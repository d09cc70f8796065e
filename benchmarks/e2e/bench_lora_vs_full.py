"""LoRA vs full fine-tuning on the real-model job, side by side: examples/smollm2_gsm8k_lora.yaml (rank-16 adapters
on every linear layer, lr 2e-5) and examples/smollm2_gsm8k.yaml (every weight, lr 2e-6) on the same workload,
launched at the same time as two processes (one torch thread each), so both see the same machine load.

Reports per step: tokens/s (prompt + response tokens of the step over its wall time), the step's phases, and the
reward; the ratio is the median over steps of LoRA's tokens/s over the full fine-tune's at the same step, and the
total tokens over the total time of each. Writes benchmarks/results/bench_lora_vs_full.json and .png (reward
curves side by side).

    python benchmarks/e2e/bench_lora_vs_full.py --steps 10 --max-new-tokens 64 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = {"lora": "examples/smollm2_gsm8k_lora.yaml", "full": "examples/smollm2_gsm8k.yaml"}


def _overrides(args, out: Path) -> list[str]:
    return [f"trainer.total_steps={args.steps}", f"data.train_batch_size={args.prompts}",
            f"actor.mini_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "trainer.save_final=false", "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false",
            "trainer.tensorboard=false", "trainer.progress_bar=false", "trainer.threads=1", f"trainer.seed={args.seed}",
            f"trainer.output_dir={out}"]


def _plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward/mean"] for r in rows], marker="o", label=name)
        axes[1].plot(steps, [r["perf/tokens_per_s"] for r in rows], marker="o", label=name)
    axes[0].set(xlabel="step", ylabel="reward/mean", title="reward")
    axes[1].set(xlabel="step", ylabel="tokens/s", title="throughput (same load)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _per_cpu_s(row: dict) -> float:
    """The step's tokens per CPU second of its process."""
    return row["perf/tokens_per_s"] * row["perf/step_time_s"] / row["perf/cpu_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_lora_vs_full.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    work = Path(tempfile.mkdtemp(prefix="verl-lora-vs-full-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {}
    t0 = time.time()
    for name, yaml in JOBS.items():
        log = open(work / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", str(ROOT / yaml), *_overrides(args, work / name)]
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (p, log) in procs.items():
        if p.wait() != 0:
            log.close()
            sys.exit(f"{name} failed:\n" + (work / f"{name}.log").read_text()[-3000:])
        log.close()
    wall = time.time() - t0
    keep = ("step", "reward/mean", "perf/tokens_per_s", "perf/step_time_s", "perf/tokens", "perf/cpu_time_s",
            "timing/generate_s", "timing/update_actor_s", "response/length", "actor/grad_norm", "perf/sync_bytes")
    curves = {}
    for name in JOBS:
        rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [{k: r[k] for k in keep if k in r} for r in rows if "reward/mean" in r]
    pairs = list(zip(curves["lora"], curves["full"]))
    total = {n: sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in rows) /
             sum(r["perf/step_time_s"] for r in rows) for n, rows in curves.items()}
    summary = dict(tokens_per_s_ratio_median=statistics.median(a["perf/tokens_per_s"] / b["perf/tokens_per_s"]
                                                             for a, b in pairs),
                   tokens_per_s_ratio_total=total["lora"] / total["full"],
                   update_time_ratio_median=statistics.median(a["timing/update_actor_s"] / b["timing/update_actor_s"]
                                                              for a, b in pairs),
                   generate_time_ratio_median=statistics.median(a["timing/generate_s"] / b["timing/generate_s"]
                                                                for a, b in pairs),
                   # the same ratio per CPU second of each job's process: what the machine's load does not move
                   tokens_per_cpu_s_ratio_median=statistics.median(_per_cpu_s(a) / _per_cpu_s(b) for a, b in pairs),
                   # the most LoRA could give here: the full job's step with its update's weight-gradient third
                   # gone (LoRA keeps the forward and the input gradients, every other phase is the same)
                   ceiling_ratio_median=statistics.median(
                       b["perf/step_time_s"] / (b["perf/step_time_s"] - b["timing/update_actor_s"] / 3)
                       for _, b in pairs),
                   reward_first={n: rows[0]["reward/mean"] for n, rows in curves.items()},
                   reward_last={n: rows[-1]["reward/mean"] for n, rows in curves.items()},
                   reward_mean_last_half={n: statistics.mean(r["reward/mean"] for r in rows[len(rows) // 2:])
                                          for n, rows in curves.items()})
    meta = {"jobs": JOBS, "overrides": _overrides(args, Path("<out>")), "jobs_wall_s": wall,
            "host": platform.node(),
            "note": "both jobs at once, one torch thread each, on a shared machine; tokens/s = the step's prompt + "
                    "response tokens over its wall time"}
    out = Path(args.out)
    write_result(out, {"summary": summary, "curves": curves}, run_info, **meta)
    _plot(curves, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
