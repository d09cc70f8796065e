"""The seed article's scaling experiment: the same PPO dataflow on 1, 2 and 4 processes, colocated and split.

The dataflow is the article's: actor generation, reward-model scoring (a reward model plus the exact-answer
rule, as a weighted ensemble), critic values and updates (GAE), the actor update and the weight sync. Every
run is `verl train` under torchrun with the same job; only the process count and `trainer.placement` change.
Weak scaling, as in the article: each process brings the same number of prompts (the batch grows with the
processes), so the per-process throughput would stay flat on ideal hardware.

Reported per run (mean over the steps after the first, which pays for start-up): total tokens/s, tokens/s per
process and its efficiency against the 1-process run, peak memory per process (the largest), and the share
of step time in communication: moving batches between rank sets (timing/transfer_s) plus the weight sync
(perf/sync_s). Gradient all-reduces inside the engines are not separated out (they count as compute).

Beside each process count, `independent` runs that many one-process jobs at once with no communication at all:
the ceiling this machine itself sets (cores, memory bandwidth), against which the real runs' efficiency reads.

    verl bench scaling                  # 10 steps (9 measured), processes 1 2 4
    verl bench scaling --steps 8 --procs 1 2
    python benchmarks/scaling/bench_scaling.py --job grpo --steps 6    # bench_grpo_vs_trl.py's tiny GRPO job
Writes benchmarks/results/bench_scaling.json and .png (--job grpo: bench_scaling_grpo.json and .png). On a
machine with fewer cores than processes the processes share cores (each runs one torch thread), and the
efficiency says so.

--job grpo scales the GRPO job of benchmarks/e2e/bench_grpo_vs_trl.py --workload tiny instead: per process 8
arithmetic prompts x 4 samples x 32 tokens (EOS ignored) on a 4-layer, 256-wide model, rule reward only, no
critic, no reference model; colocated only (there is no second role to split off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROMPTS_PER_PROCESS = 8


def grpo_job(nproc: int, out_dir: str, steps: int) -> list[str]:
    """bench_grpo_vs_trl.py's tiny GRPO job, with every process bringing its 8 prompts x 4 samples."""
    prompts = PROMPTS_PER_PROCESS * nproc
    return ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.num_heads=4",
            "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=512", "data.task=arithmetic",
            f"data.train_batch_size={prompts}", f"actor.mini_batch_size={prompts}", "actor.micro_batch_size=32",
            "rollout.n=4", "rollout.max_new_tokens=32", "rollout.ignore_eos=true", "algorithm.adv_estimator=grpo",
            "actor.use_kl_loss=false", "actor.optim.lr=1e-4", "data.max_prompt_length=64", "warmup.steps=0",
            f"trainer.total_steps={steps}", "trainer.threads=1", "trainer.device=cpu", "trainer.save_final=false",
            "trainer.export_hf=false", "trainer.plot=false", "trainer.progress_bar=false",
            "trainer.tensorboard=false", f"trainer.output_dir={out_dir}"]


def job(nproc: int, placement: str, reward_model: str, out_dir: str, steps: int, kind: str = "ppo") -> list[str]:
    """The overrides of one run: the same model, task, sampling and per-process work everywhere."""
    if kind == "grpo":
        return grpo_job(nproc, out_dir, steps)
    prompts = PROMPTS_PER_PROCESS * nproc
    actor_ranks = nproc // 2 if placement == "split" else nproc
    n = 4
    return ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.num_heads=8",
            "model.tiny.num_kv_heads=4", "model.tiny.intermediate_size=512", "data.task=arithmetic",
            f"data.train_batch_size={prompts}", f"actor.mini_batch_size={prompts}",
            f"actor.micro_batch_size={prompts * n // actor_ranks}", f"critic.micro_batch_size={prompts * n // actor_ranks}",
            f"rollout.n={n}", "rollout.max_new_tokens=16", "rollout.ignore_eos=true", "algorithm.adv_estimator=gae",
            f"reward.sources=[{{type: rule, name: arithmetic, weight: 1.0}}, "
            f"{{type: model, model_path: {reward_model}, weight: 0.1, label: rm}}]",
            "warmup.steps=0", f"trainer.total_steps={steps}", f"trainer.placement={placement}", "trainer.threads=1",
            "trainer.device=cpu", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
            "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.output_dir={out_dir}"]


def make_reward_model(path: str) -> None:
    """A random sequence-classification model over the task's tokenizer (what scoring costs is the point)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from verl.data import task_corpus
    from verl.models.tiny import tiny_tokenizer
    tok = tiny_tokenizer(task_corpus("arithmetic"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def _launch(nproc: int, placement: str, reward_model: str, out: str, steps: int, port: int,
            kind: str = "ppo") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port", str(port),
           "-m", "verl.trainer.main_ppo", *job(nproc, placement, reward_model, out, steps, kind)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _measured(out: str) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    return [r for r in rows if "perf/tokens_per_s" in r][1:]  # the first step pays for start-up


def control(nproc: int, reward_model: str, work: str, steps: int, kind: str = "ppo") -> dict:
    """The machine's own ceiling: `nproc` independent one-process jobs at once (no communication at all), so
    the efficiency of a real run can be read against what sharing the machine alone costs."""
    outs = [os.path.join(work, f"control_{nproc}_{i}") for i in range(nproc)]
    procs = [_launch(1, "colocated", reward_model, o, steps, 29700 + 10 * nproc + i, kind) for i, o in enumerate(outs)]
    errors = [p.communicate(timeout=3600)[1] for p in procs]
    if any(p.returncode for p in procs):
        return {"processes": nproc, "placement": "independent", "error": "\n".join(errors)[-2000:]}
    per = [sum(r["perf/tokens_per_s"] for r in rows) / len(rows) for rows in map(_measured, outs)]
    return {"processes": nproc, "placement": "independent", "tokens_per_s": sum(per),
            "tokens_per_s_per_process": sum(per) / nproc}


def run(nproc: int, placement: str, reward_model: str, work: str, steps: int, kind: str = "ppo") -> dict:
    out = os.path.join(work, f"{placement}_{nproc}")
    proc = _launch(nproc, placement, reward_model, out, steps, 29500 + nproc + (50 if placement == "split" else 0),
                   kind)
    _, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        return {"processes": nproc, "placement": placement, "error": err[-2000:]}
    rows = _measured(out)
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
    step = mean("perf/step_time_s")
    comm = mean("timing/transfer_s") + mean("perf/sync_s")
    return {"processes": nproc, "placement": placement, "steps_measured": len(rows),
            "tokens_per_s": mean("perf/tokens_per_s"), "tokens_per_s_per_process": mean("perf/tokens_per_s") / nproc,
            "step_time_s": step, "peak_memory_mb_per_process": max(r["perf/peak_memory_mb"] for r in rows),
            "transfer_s": mean("timing/transfer_s"), "sync_s": mean("perf/sync_s"),
            "communication_share": comm / step if step else 0.0, "reward_mean": mean("reward/mean")}


def _plot(rows: list[dict], path: str, job: str = "ppo") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for placement, marker in (("colocated", "o"), ("split", "s"), ("independent", "x")):
        pts = [r for r in rows if r["placement"] == placement and "error" not in r]
        if pts:
            ax[0].plot([r["processes"] for r in pts], [r["tokens_per_s"] for r in pts], marker=marker, label=placement)
            ax[1].plot([r["processes"] for r in pts], [r["efficiency"] for r in pts], marker=marker, label=placement)
    ax[0].set(xlabel="processes", ylabel="tokens/s (total)", title=f"{job.upper()} throughput")
    ax[1].set(xlabel="processes", ylabel="per-process tokens/s vs 1 process", title="per-process efficiency",
              ylim=(0, 1.2))
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the default settings (kept for the suite runner)")
    ap.add_argument("--no-control", action="store_true", help="skip the independent-processes ceiling rows")
    ap.add_argument("--job", choices=["ppo", "grpo"], default="ppo",
                    help="ppo: the article's PPO dataflow (default); grpo: bench_grpo_vs_trl's tiny GRPO job")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        rm = os.path.join(work, "reward_model")
        make_reward_model(rm)
        for nproc in args.procs:
            for placement in ("colocated", "split") if nproc > 1 and args.job == "ppo" else ("colocated",):
                row = run(nproc, placement, rm, work, args.steps, args.job)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if nproc > 1 and not args.no_control:
                rows.append(control(nproc, rm, work, args.steps, args.job))
                print(json.dumps(rows[-1]), flush=True)
    base = next((r["tokens_per_s_per_process"] for r in rows if r["processes"] == 1 and "error" not in r), None)
    ceiling = {r["processes"]: r["tokens_per_s_per_process"] for r in rows
               if r["placement"] == "independent" and "error" not in r}
    for r in rows:
        if "error" not in r and base:
            r["efficiency"] = r["tokens_per_s_per_process"] / base
        if "error" not in r and r["processes"] in ceiling:  # what the framework keeps of what the machine allows
            r["vs_ceiling"] = r["tokens_per_s_per_process"] / ceiling[r["processes"]]
    print(f"\n{'procs':>5} {'placement':>11} {'tok/s':>9} {'tok/s/proc':>10} {'eff':>6} {'peak MB':>8} "
          f"{'comm %':>7} {'step s':>7} {'vs ceiling':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['processes']:>5} {r['placement']:>11}  failed: {r['error'][-300:]}")
            continue
        print(f"{r['processes']:>5} {r['placement']:>11} {r['tokens_per_s']:>9.0f} {r['tokens_per_s_per_process']:>10.0f} "
              f"{r.get('efficiency', float('nan')):>6.2f} {r.get('peak_memory_mb_per_process', float('nan')):>8.0f} "
              f"{100 * r.get('communication_share', float('nan')):>7.1f} {r.get('step_time_s', float('nan')):>7.2f} "
              f"{r.get('vs_ceiling', float('nan')):>10.2f}")
    os.makedirs(args.out, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "machine": platform.machine(), "prompts_per_process": PROMPTS_PER_PROCESS,
            "steps": args.steps, "note": "weak scaling; communication = batch redistribution + weight sync",
            "job": args.job}
    name = "bench_scaling" if args.job == "ppo" else "bench_scaling_grpo"
    write_result(os.path.join(args.out, f"{name}.json"), {"meta": meta, "rows": rows}, run_info)
    _plot(rows, os.path.join(args.out, f"{name}.png"), args.job)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
