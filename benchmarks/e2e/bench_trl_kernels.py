"""TRL's GRPOTrainer with and without verl's kernels on the same run: peak memory and step time, as ratios.

Both sides train the same saved model (a 2-layer Llama with a 32k vocabulary, so the LM head is most of the
update's work; examples/kernels_in_trl.py `demo_setup`) on the same prompts, reward, sampling settings, seed and
completion length (`min_new_tokens` = `max_completion_length`, so every step does equal work whatever is sampled):
  trl    trl.GRPOTrainer                                   (its chunked LM head + the loss in [B, T] torch ops)
  verl   examples/kernels_in_trl.VerlGRPOTrainer           (_compute_loss through verl.ops.linear_rl_loss)
Each run is its own process (one torch thread, MALLOC_MMAP_THRESHOLD_=65536 so freed memory returns to the OS);
the rounds alternate which side goes first. Per side, the median over every measured step (the first step of a
run, with its one-off allocations, is left out) of:
  step_cpu_s     process CPU time of a whole optimizer step (generation, scoring, reference log-probs, update)
  update_cpu_s   CPU time of the step minus generation and scoring (_prepare_inputs): the loss forward + backward
  update_peak_mib  peak resident memory during the loss forward + backward, above the resident set before it
  peak_rss_mib   the process's peak resident set over the whole run
CPU time, not wall time, is compared: the machine is shared, and a descheduled process's wall time measures its
neighbours (wall times are recorded beside). Ratios are verl / trl. Run with the TRL environment's python:

    venv=$(bash scripts/setup_env.sh trl | tail -n1)
    PYTHONPATH=. $venv/bin/python benchmarks/e2e/bench_trl_kernels.py --rounds 2 --steps 4
    PYTHONPATH=. $venv/bin/python benchmarks/e2e/bench_trl_kernels.py --quick --out /tmp/q.json   # CI: a small
        # model (vocab 4096), 8 completions of 16 tokens, 1 round of 3 steps per side: runs, not a measurement
Writes benchmarks/results/bench_trl_kernels.json (meta: the command, commit and machine load; verl.utils.results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDES = ("trl", "verl")


def _status() -> tuple[float, float]:
    with open("/proc/self/status") as f:
        s = f.read()
    return (int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) / 1024, int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024)


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status()[1]


def _measured(cls):
    """`cls` with the update phase of each training_step timed and its peak memory taken."""

    class Measured(cls):
        records: list = []

        def _prepare_inputs(self, generation_batch):
            t0 = time.process_time()
            out = super()._prepare_inputs(generation_batch)
            self._rec["prepare_cpu_s"] += time.process_time() - t0
            self._rec["update_base_mib"] = _reset_peak()
            return out

        def training_step(self, model, inputs, num_items_in_batch):
            self._rec = {"prepare_cpu_s": 0.0}
            w0, c0 = time.perf_counter(), time.process_time()
            out = super().training_step(model, inputs, num_items_in_batch)
            c1, w1 = time.process_time(), time.perf_counter()
            rec = self._rec
            rec["update_peak_mib"] = _status()[0] - rec.pop("update_base_mib")
            rec.update(train_step_cpu_s=c1 - c0, train_step_wall_s=w1 - w0,
                       update_cpu_s=c1 - c0 - rec["prepare_cpu_s"])
            self.records.append(rec)
            return out

    return Measured


def worker(side: str, model_dir: str, steps: int, out_path: str, batch: int, group: int, new_tokens: int) -> None:
    import torch
    torch.set_num_threads(1)
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from kernels_in_trl import VerlGRPOTrainer, demo_data

    tok = AutoTokenizer.from_pretrained(model_dir)
    ds, reward = demo_data(tok, batch // group)
    cls = _measured(VerlGRPOTrainer if side == "verl" else GRPOTrainer)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.cpu, self.wall = [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.cpu.append(time.process_time() - self.t[0])
            self.wall.append(time.perf_counter() - self.t[1])

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-kernels-"), use_cpu=True, bf16=False,
                     per_device_train_batch_size=batch, num_generations=group, max_completion_length=new_tokens,
                     generation_kwargs={"min_new_tokens": new_tokens}, learning_rate=1e-5, max_steps=steps,
                     logging_steps=1, report_to=[], save_strategy="no", beta=0.04, temperature=1.0, seed=1,
                     dataloader_num_workers=0, shuffle_dataset=False, disable_tqdm=True)
    clock = StepClock()
    trainer = cls(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                  callbacks=[clock])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    json.dump({"step_cpu_s": clock.cpu, "step_wall_s": clock.wall, "records": cls.records,
               "peak_rss_mib": _status()[0], "loss": [h["loss"] for h in logs],
               "reward": [h.get("reward") for h in logs], "entropy": [h.get("entropy") for h in logs],
               "mean_completion_length": [h.get("completions/mean_length") for h in logs]}, open(out_path, "w"))


def _run(side, model_dir, args, tmp) -> dict:
    out = os.path.join(tmp, f"{side}-{time.time_ns()}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--worker", side, model_dir, str(args.steps), out, str(args.batch),
           str(args.group), str(args.new_tokens)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{side} run failed:\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _summary(runs: list[dict]) -> dict:
    """Medians over every run's steps but the first."""
    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    pick = lambda key: [v for r in runs for v in r[key][1:]]  # noqa: E731
    recs = [rec for r in runs for rec in r["records"][1:]]
    return {"step_cpu_s": med(pick("step_cpu_s")), "step_wall_s": med(pick("step_wall_s")),
            "update_cpu_s": med([r["update_cpu_s"] for r in recs]),
            "update_peak_mib": med([r["update_peak_mib"] for r in recs]),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "steps_measured": len(recs)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], a[1], int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, alternating which goes first")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not measured)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="completions per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per completion (all of them generated)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--quick", action="store_true", help="CI size: --rounds 1 --steps 3 --vocab 4096 --hidden 64 "
                                                         "--batch 8 --new-tokens 16")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_trl_kernels.json"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.vocab, args.hidden, args.batch, args.new_tokens = 1, 3, 4096, 64, 8, 16
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from kernels_in_trl import demo_setup

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-trl-kernels-") as tmp:
        model_dir = demo_setup(os.path.join(tmp, "model"), vocab_size=args.vocab, hidden_size=args.hidden,
                               prompts=args.batch // args.group)[0]
        runs = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                runs[side].append(_run(side, model_dir, args, tmp))
                print(f"round {r} {side}: step cpu {runs[side][-1]['step_cpu_s']}", flush=True)
    summ = {s: _summary(runs[s]) for s in SIDES}
    v, t = summ["verl"], summ["trl"]
    ratios = {k: v[k] / t[k] for k in ("step_cpu_s", "update_cpu_s", "update_peak_mib", "peak_rss_mib",
                                       "step_wall_s")}
    meta = {"model": f"2-layer Llama, hidden {args.hidden}, vocab {args.vocab} (random weights, float32)",
            "batch": f"{args.batch} completions ({args.batch // args.group} prompts x {args.group}), "
                     f"{args.new_tokens} tokens each; beta=0.04, loss_type dapo (TRL's default), lr 1e-5",
            "threads": 1, "processor": platform.processor() or platform.machine(),
            "note": "medians over the steps of every run but each run's first; ratios are verl / trl"}
    write_result(args.out, {"summary": summ, "ratios_verl_vs_trl": ratios, "runs": runs}, run, **meta)
    print(json.dumps({"summary": summ, "ratios_verl_vs_trl": ratios}, indent=2))
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
