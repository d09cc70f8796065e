"""int8 rollout (rollout.quantization=int8) beside float32: generation speed and mismatch on the example job's
model, and the reward curve of the tiny default job.

    python benchmarks/quant/bench_quant.py            # both parts (verl bench quant)
    python benchmarks/quant/bench_quant.py --part generate --max-new-tokens 256 --repeats 2
    python benchmarks/quant/bench_quant.py --part curves --steps 50 --seeds 1 2
    python benchmarks/quant/bench_quant.py --part job --job-steps 2 --out benchmarks/results/bench_quant_job.json

generate: SmolLM2-135M-Instruct (float32), the example job's generation (8 gsm_symbolic chat prompts x 4 samples,
temperature 1, seeded), `ignore_eos` so that both sides decode exactly the same number of tokens, one torch thread
(examples/smollm2_gsm8k.yaml's trainer.threads=1), the torch engine's fast decoder with rollout.quantization none
and int8 on the same loaded weights, alternating (fp32, int8, fp32, int8, ...) so that machine load hits both
alike. Reported: tokens/s of each and their ratio, and the mismatch the trainer would log (rollout/mismatch_kl
etc., verl.algos.objectives.rollout_mismatch) of each side's samples against the float32 model's own forward.
curves: `verl train` (the default job: tiny Llama, arithmetic, GRPO) for --steps steps per seed, float32 and int8
(which turns token-level truncated IS on), the reward per step, and whether int8's final reward (mean of the last
10 steps over its seeds) lies within the float32 runs' seed-to-seed spread.
job: the example job itself (examples/smollm2_gsm8k.yaml) for --job-steps steps per side, its phase times.
Writes benchmarks/results/bench_quant.json (rendered into docs/benchmarks.md by scripts/render_results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _teacher_forced(model, prompt: list[int], tokens: list[int]):
    import torch
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def generate_part(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from verl.algos.objectives import rollout_mismatch
    from verl.data import make_task
    from verl.models.pretrained import resolve_model_path
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.rollout.tokenizer import Tokenizer
    torch.set_num_threads(1)
    model_dir = str(resolve_model_path("smollm2-135m-instruct"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(model_dir)
    prompts = [tok.encode_prompt(r["prompt"]) for r in make_task("gsm_symbolic", 8, seed=0)]
    params = SamplingParams(n=4, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1234, ignore_eos=True,
                            logprobs=True)
    engines = {q: build_rollout(RolloutConfig(engine="torch", quantization=q, max_batch_size=32), model=model,
                                tokenizer=tok) for q in ("none", "int8")}
    for eng in engines.values():  # warm-up (also quantizes once)
        eng.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0))
    rows = {q: {"generate_s": [], "tokens": 0} for q in engines}
    outs = {}
    for r in range(args.repeats):
        for q, eng in engines.items():
            t = time.perf_counter()
            outs[q] = eng.generate(prompts, params)
            rows[q]["generate_s"].append(time.perf_counter() - t)
            rows[q]["tokens"] = sum(len(o.token_ids) for o in outs[q])
            print(f"[quant] repeat {r} {q}: {rows[q]['generate_s'][-1]:.1f} s", flush=True)
        metrics = engines["int8"].take_metrics()
        rows["int8"]["quantize_s"] = metrics.get("rollout/quantize_s")
        rows["int8"]["quantized_layers"] = metrics.get("rollout/quantized_layers")
    for q in engines:
        train, roll = [], []
        for o in outs[q]:
            train.append(_teacher_forced(model, list(o.prompt_token_ids), list(o.token_ids)))
            roll.append(torch.tensor(o.logprobs))
        t, ro = torch.cat(train), torch.cat(roll)
        rows[q]["mismatch"] = rollout_mismatch(t, ro, torch.ones_like(t))
        best = min(rows[q]["generate_s"])
        rows[q]["tokens_per_s"] = rows[q]["tokens"] / (sum(rows[q]["generate_s"]) / len(rows[q]["generate_s"]))
        rows[q]["tokens_per_s_best"] = rows[q]["tokens"] / best
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs["none"], outs["int8"]))
    res = {"model": "smollm2-135m-instruct (float32 weights; int8 = weight-only per output row)",
           "job": {"prompts": 8, "n": 4, "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                   "temperature": 1.0, "threads": 1, "repeats": args.repeats},
           "fp32": rows["none"], "int8": rows["int8"],
           "speedup_tokens_per_s": rows["int8"]["tokens_per_s"] / rows["none"]["tokens_per_s"],
           "speedup_best": rows["int8"]["tokens_per_s_best"] / rows["none"]["tokens_per_s_best"],
           "identical_samples": same, "samples": len(outs["none"]),
           "differs": "nothing but rollout.quantization: same weights, prompts, seeds, lengths (ignore_eos)"}
    kl = {q: rows[q]["mismatch"]["rollout/mismatch_kl"] for q in rows}
    print(f"[quant] tokens/s fp32 {rows['none']['tokens_per_s']:.1f} int8 {rows['int8']['tokens_per_s']:.1f} "
          f"({res['speedup_tokens_per_s']:.2f}x); mismatch_kl fp32 {kl['none']:.2e} int8 {kl['int8']:.2e}", flush=True)
    return res


def _train(steps: int, seed: int, quant: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"{quant}-{seed}")
    cmd = [sys.executable, "-m", "verl.cli.main", "train", f"trainer.total_steps={steps}", f"trainer.seed={seed}",
           f"rollout.seed={seed}", f"rollout.quantization={quant}", f"trainer.output_dir={out}",
           "trainer.save_every=0"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    steps_rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_rows = [r for r in steps_rows if "reward/mean" in r]
    keys = ("reward/mean", "rollout/mismatch_kl", "rollout_corr/is_weight_mean", "rollout_corr/is_truncated_frac")
    return {"quantization": quant, "seed": seed, "wall_s": wall,
            "curve": {k: [r.get(k) for r in steps_rows] for k in keys}}


def curves_part(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="verl-bench-quant-")
    runs = []
    for seed in args.seeds:
        for quant in ("none", "int8"):
            runs.append(_train(args.steps, seed, quant, tmp))
            print(f"[quant] curve seed {seed} {quant}: final reward "
                  f"{runs[-1]['curve']['reward/mean'][-1]:.3f} ({runs[-1]['wall_s']:.0f} s)", flush=True)

    def final(r):
        tail = r["curve"]["reward/mean"][-10:]
        return sum(tail) / len(tail)

    fp = [final(r) for r in runs if r["quantization"] == "none"]
    q8 = [final(r) for r in runs if r["quantization"] == "int8"]
    spread = max(fp) - min(fp)
    gap = abs(sum(q8) / len(q8) - sum(fp) / len(fp))
    return {"job": "verl train (the default job) trainer.total_steps=%d, seeds %s" % (args.steps, args.seeds),
            "runs": runs, "final_reward_fp32": fp, "final_reward_int8": q8, "fp32_seed_spread": spread,
            "int8_gap": gap, "within_spread": gap <= spread,
            "final_is": "mean reward/mean of the last 10 steps of each run; gap: |mean int8 - mean fp32|"}


def job_part(args) -> dict:
    """The example job itself (examples/smollm2_gsm8k.yaml), --job-steps steps with each quantization, alternating
    per step count: per-step phase times from its metrics (generation differs in what it samples, so the lengths
    are reported beside the times and generation is compared per token)."""
    tmp = tempfile.mkdtemp(prefix="verl-bench-quant-job-")
    runs = {}
    for quant in ("none", "int8"):
        out = os.path.join(tmp, quant)
        cmd = [sys.executable, "-m", "verl.cli.main", "train", "examples/smollm2_gsm8k.yaml",
               f"trainer.total_steps={args.job_steps}", f"rollout.quantization={quant}", f"trainer.output_dir={out}",
               "trainer.save_every=0", "trainer.save_final=false", "trainer.export_hf=false"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows = [r for r in rows if "reward/mean" in r]
        keys = ("perf/step_time_s", "timing/generate_s", "timing/update_actor_s", "timing/old_log_prob_s",
                "response/length", "rollout/mismatch_kl", "rollout/quantize_s", "reward/mean")
        runs[quant] = {"steps": [{k: r.get(k) for k in keys} for r in rows]}
        gen_tokens = [r["response/length"] * 32 for r in rows]  # 8 prompts x 4 samples
        runs[quant]["generate_tokens_per_s"] = sum(gen_tokens) / sum(r["timing/generate_s"] for r in rows)
        runs[quant]["step_s_mean"] = sum(r["perf/step_time_s"] for r in rows) / len(rows)
        print(f"[quant] job {quant}: {runs[quant]['step_s_mean']:.0f} s/step, generation "
              f"{runs[quant]['generate_tokens_per_s']:.1f} tokens/s", flush=True)
    ratio = runs["int8"]["generate_tokens_per_s"] / runs["none"]["generate_tokens_per_s"]
    return {"job": f"verl train examples/smollm2_gsm8k.yaml trainer.total_steps={args.job_steps}", "runs": runs,
            "generate_tokens_per_s_ratio": ratio,
            "differs": "the samples (int8 samples from its own distribution), so lengths and rewards differ; "
                       "int8 also turns token-level IS on (its weights come from the update's own forward: one "
                       "no-grad LM-head pass per micro-batch)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "generate", "curves", "job"], default="all")
    ap.add_argument("--job-steps", type=int, default=2, help="--part job: steps of the example job per side")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_quant.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    res = {"benchmark": "quant", "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    if args.part in ("all", "curves"):
        res["curves"] = curves_part(args)
    if args.part in ("all", "generate"):
        res["generate"] = generate_part(args)
    if args.part == "job":  # not part of "all": ~10 minutes per side on 2 CPU cores
        res["job"] = job_part(args)
    write_result(args.out, res, run)
    print(f"[quant] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
