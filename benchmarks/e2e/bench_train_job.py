"""A whole `verl train` job, timed from the outside: the figures the docs quote about running a job (the
default job's reward and wall time, a real model's step time) come from here, not from a hand-read log.

    python benchmarks/e2e/bench_train_job.py                        # the default job (verl train, no arguments)
    python benchmarks/e2e/bench_train_job.py --quick                # the same (the suite runner's flag)
    python benchmarks/e2e/bench_train_job.py --config examples/smollm2_gsm8k.yaml --set trainer.total_steps=2 \
        --tag smollm2_gsm8k                                         # SmolLM2 on GSM8K-style problems, 2 steps
    python benchmarks/e2e/bench_train_job.py --config examples/moe_tiny.yaml --nproc 2 --set actor.megatron.ep=2 \
        --tag moe_tiny_ep2                                          # under torchrun, 2 processes
    python benchmarks/e2e/bench_train_job.py --config examples/agent_arithmetic.yaml --tag agent_arithmetic \
        --keys rollout/tool_use_rate --trace 20                     # an extra curve, and step 20's trace

The job runs as `python -m verl.trainer.main_ppo [CONFIG] [overrides]` in a subprocess (its own output folder in
a temporary directory, no checkpoints or exported model unless the config asks), at whatever niceness this
process has. Recorded: the process's wall time and CPU time (its own cost on a shared machine), each step's time
and CPU time (perf/step_time_s, perf/cpu_time_s) and the rollout / update split (timing/generate_s, timing/update_actor_s), the mean reward of the
first and last `--window` steps (and of every `--keys` metric), and the machine's load average before and after
(in meta). Writes benchmarks/results/train_<tag>.json (tag default_job by default) and, with `--trace STEP`, that
step's Chrome trace as benchmarks/results/train_<tag>_trace.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["trainer.save_final=false", "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false",
         "trainer.progress_bar=false", "trainer.tensorboard=false"]


def run_job(config: str | None, overrides: list[str], out_dir: str, timeout: float,
            nproc: int = 1) -> tuple[float, float, list[dict]]:
    """(wall seconds of the job's process, its CPU seconds (all threads, user + system, every rank's), its
    metrics.jsonl rows of training steps). `nproc` > 1: under torchrun on this machine."""
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  f"--nproc_per_node={nproc}", "--monitor-interval=0.5"]
    cmd = [*launch, "-m", "verl.trainer.main_ppo", *([config] if config else []), *QUIET, *overrides,
           f"trainer.output_dir={out_dir}"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl")) if line.strip()]
    return wall, cpu, [r for r in rows if "reward/mean" in r]


def summarise(rows: list[dict], window: int, keys: list[str] = ()) -> dict:
    def col(key: str) -> list[float]:
        return [r[key] for r in rows if key in r]
    w = min(window, len(rows))
    rewards = col("reward/mean")
    out = {"steps": len(rows), "window": w,
           "reward_first": statistics.mean(rewards[:w]), "reward_last": statistics.mean(rewards[-w:]),
           "step_time_s": col("perf/step_time_s"), "cpu_time_s": col("perf/cpu_time_s"),
           "generate_s": col("timing/generate_s"), "update_actor_s": col("timing/update_actor_s"),
           "response_length": col("response/length"), "reward_curve": rewards}
    for key in keys:
        values = col(key)
        if values:
            out[key] = {"first": statistics.mean(values[:w]), "last": statistics.mean(values[-w:]), "curve": values}
    for key in ("step_time_s", "cpu_time_s"):
        if out[key]:
            out[f"{key}_median"] = statistics.median(out[key])
            out[f"{key}_total"] = sum(out[key])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="job config (default: the default job)")
    ap.add_argument("--set", nargs="*", default=[], help="overrides (key=value)")
    ap.add_argument("--window", type=int, default=10, help="steps averaged for the first / last reward")
    ap.add_argument("--tag", default="default_job")
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    ap.add_argument("--quick", action="store_true", help="the default job as it is (the suite runner's flag)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--nproc", type=int, default=1, help="processes (torchrun on this machine when > 1)")
    ap.add_argument("--keys", nargs="*", default=[], help="other metrics summarised like the reward (first / last)")
    ap.add_argument("--trace", type=int, default=0, help="keep this step's Chrome trace (trainer.trace_step)")
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    overrides = [*args.set, *([f"trainer.trace_step={args.trace}"] if args.trace else [])]
    with tempfile.TemporaryDirectory(prefix="bench-train-job-") as work:
        wall, cpu, rows = run_job(args.config, overrides, os.path.join(work, "run"), args.timeout, args.nproc)
        if args.trace:
            shutil.copyfile(os.path.join(work, "run", f"trace_step_{args.trace}.json"),
                            os.path.join(args.out, f"train_{args.tag}_trace.json"))
    result = {"job_wall_s": wall, "job_cpu_s": cpu, "processes": args.nproc, **summarise(rows, args.window, args.keys)}
    path = os.path.join(args.out, f"train_{args.tag}.json")
    write_result(path, result, run, config=args.config or "verl/trainer/config/default.yaml", overrides=args.set,
                 nice=os.nice(0))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
