"""Router replay from real runs: the MoE default job (examples/moe_tiny.yaml: a tiny Qwen3-MoE-style policy on the
megatron engine, the torch rollout engine) trained in bfloat16 with actor.router_replay=off and =rollout, and two
dense baselines on the same engines and dtype: the MoE job's dense twin (the same job and shape with a dense
Qwen3 policy: the same attention, q/k norms and width, one MLP instead of the experts), the like-for-like
baseline, and the dense default job (a Llama policy of the same width, no q/k norms).

Per run, averaged over its GRPO steps: moe/router_mismatch_frac (the share of (token, MoE layer) routing decisions
where the actor's forward picked other experts than the rollout engine did; with replay, the experts it used),
the rollout/train log-prob mismatch (rollout/mismatch_mean: mean |log p_train - log p_rollout| of the sampled
tokens; mismatch_kl), the expert load balance and the reward first -> last. In float32 the two engines route
identically on this model (the figure is 0 with replay off too), so the runs are bfloat16, where the engines'
rounding differs (transformers computes the router logits in bfloat16, megatron in float32).

    python benchmarks/e2e/bench_router_replay.py                 # 4 runs x 30 GRPO steps (+ the warm start)
Writes benchmarks/results/bench_router_replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16 = ["model.dtype=bfloat16", "actor.megatron.params_dtype=bfloat16"]
RUNS = {
    "moe_replay_off": ["examples/moe_tiny.yaml", "actor.router_replay=off", *BF16],
    "moe_replay_on": ["examples/moe_tiny.yaml", "actor.router_replay=rollout", *BF16],
    "dense_twin": ["examples/moe_tiny.yaml", "model.tiny.family=qwen3", "actor.router_replay=off", *BF16],
    "dense": ["verl/trainer/config/default.yaml", "actor.engine=megatron", *BF16],
}
KEYS = ("moe/router_mismatch_frac", "rollout/mismatch_mean", "rollout/mismatch_kl", "moe/expert_load_max_over_mean",
        "moe/aux_loss")


def _run(name: str, args: list[str], steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args, f"trainer.total_steps={steps}",
           f"trainer.output_dir={out}", "trainer.save_every=0", "trainer.save_final=false", "val.num_examples=0",
           "trainer.export_hf=false", "trainer.plot=false", "trainer.tensorboard=false"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200)
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{p.stderr[-3000:]}")
    steps_m = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_m = [m for m in steps_m if "reward/mean" in m]
    row = {"command": "python -m verl.trainer.main_ppo " + " ".join(args), "steps": len(steps_m),
           "reward_first": steps_m[0]["reward/mean"], "reward_last": steps_m[-1]["reward/mean"]}
    for k in KEYS:
        vals = [m[k] for m in steps_m if k in m]
        if vals:
            row[k] = statistics.mean(vals)
            row[k + "_max"] = max(vals)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps per run (after the 300-step warm start)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_router_replay.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    tmp = tempfile.mkdtemp(prefix="verl-bench-replay-")
    rows = {}
    for name, run_args in RUNS.items():
        rows[name] = _run(name, run_args, args.steps, tmp)
        r = rows[name]
        print(f"{name:<15} router mismatch {r.get('moe/router_mismatch_frac', float('nan')):.4f}  log-prob mismatch "
              f"{r['rollout/mismatch_mean']:.2e} (kl {r['rollout/mismatch_kl']:.2e})  "
              f"reward {r['reward_first']:.3f} -> "
              f"{r['reward_last']:.3f}", flush=True)
    meta = {"dtype": "bfloat16", "steps": args.steps}
    write_result(args.out, {"meta": meta, "runs": rows}, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
