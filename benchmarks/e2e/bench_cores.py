"""Both CPU cores on the smollm2-gsm8k example job: one process on one thread, one process on two threads, and two
single-threaded processes in one_step_off (actor and reward on rank 0, rollout on rank 1), run one after another.

    python benchmarks/e2e/bench_cores.py

Every side is `verl train examples/smollm2_gsm8k.yaml` itself (the same config, seed, prompts and sampling), for
--steps steps; the steps after the first are measured (one_step_off's first step cannot overlap anything): trained
tokens per second of wall time (perf/tokens_per_s, the job's own metric) and the step's phases. The machine's
1-minute load average after each side is recorded, since other jobs on the cores change the answer. Writes
benchmarks/results/bench_cores.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

COMMON = ["trainer.save_final=false", "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false",
          "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.overwrite=true"]
SIDES = {
    "1 process x 1 thread": (1, ["trainer.threads=1"]),
    "1 process x 2 threads": (1, ["trainer.threads=2"]),
    "2 processes x 1 thread, one_step_off": (2, ["trainer.threads=1", "trainer.mode=one_step_off",
                                                  "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
                                                  "reward.ranks=[0]"]),
}


def run(name: str, procs: int, overrides: list[str], steps: int, work: str, port: int) -> dict:
    out = os.path.join(work, str(abs(hash(name))))
    job = [os.path.join(ROOT, "examples", "smollm2_gsm8k.yaml"), f"trainer.total_steps={steps}",
           f"trainer.output_dir={out}", *COMMON, *overrides]
    cmd = ([sys.executable, "-m", "verl.cli.main", "train", *job] if procs == 1 else
           [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_port", str(port),
            "-m", "verl.trainer.main_ppo", *job])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "perf/tokens_per_s" in r]
    measured = rows[1:]
    tokens = sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in measured)
    seconds = sum(r["perf/step_time_s"] for r in measured)
    phases = sorted({k for r in measured for k in r if k.startswith("timing/")})
    return {"side": name, "processes": procs, "overrides": overrides, "steps_measured": len(measured),
            "tokens_per_s": tokens / seconds, "step_time_s": seconds / len(measured),
            "phases_s": {k: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in phases},
            "response_length": sum(r.get("response/length", 0.0) for r in measured) / len(measured),
            "load_avg_1min_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--set", nargs="*", default=[], help="overrides of every side's job (e.g. a smoke-sized run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cores.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    work = tempfile.mkdtemp(prefix="verl-bench-cores-")
    rows = []
    for i, name in enumerate(args.sides):
        procs, overrides = SIDES[name]
        rows.append(run(name, procs, [*overrides, *args.set], args.steps, work, 29600 + i))
        print(f"[cores] {name}: {rows[-1]['tokens_per_s']:.1f} tokens/s, {rows[-1]['step_time_s']:.0f} s/step",
              flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_first"] = r["tokens_per_s"] / base
    best = max(rows, key=lambda r: r["tokens_per_s"])
    res = {"job": f"verl train examples/smollm2_gsm8k.yaml trainer.total_steps={args.steps}", "cpus": os.cpu_count(),
           "sides": rows, "fastest": best["side"],
           "differs": "only the processes, threads and (two processes) one_step_off, which trains each step on the "
                      "previous weights' samples; each side samples its own responses, so lengths differ"}
    write_result(args.out, res, run_info)
    print(json.dumps({"fastest": best["side"], **{r["side"]: round(r["vs_first"], 2) for r in rows}}))


if __name__ == "__main__":
    main()
