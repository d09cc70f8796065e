"""The seed article's engine experiment: the same prompts and config through every generation engine, changing
only `rollout.engine`.

    for engine in ["torch", "vllm", "sglang"]:      # (+ "hf", transformers' generate, as a reference row)
        outs = build_rollout(RolloutConfig(engine=engine, ...), model_path=model).generate(prompts, params)

Every engine runs in its own process (so its peak memory is its own), on a local random Llama in float32 (no
hub), with `ignore_eos` so every sample has exactly `max_new_tokens` tokens, and one torch thread. Reported per
engine: mean generation time of one generate() call over all prompts (after a warm-up; `--repeats` calls),
generated tokens/s, start-up time, peak memory (resident set on CPU, allocated on GPU), and token agreement
with the torch engine — greedy, and at temperature 1 with a fixed seed (the shared seeding convention of
verl.rollout.base makes seeded sampling comparable across engines). An engine that cannot run here is a row
that says why. vLLM runs from its own environment (`bash scripts/setup_env.sh vllm`), found automatically.

    verl bench engines                 # --quick (default): 16 prompts x 48 tokens, ~3M parameters
    verl bench engines --full          # 32 prompts x 128 tokens, ~24M parameters
Writes benchmarks/results/bench_engines.json and .png.

    python benchmarks/engines/bench_engines.py --workload smollm2-gsm8k --engines torch torch-model hf vllm
The example job's generation (examples/smollm2_gsm8k.yaml): SmolLM2-135M-Instruct, 8 gsm_symbolic chat prompts x
4 samples, temperature 1 with a fixed seed, up to 256 tokens ending at EOS, one batch, one call per engine
(after a short warm-up). torch-model is the torch engine on the model's own forward (rollout.decoder=model)
instead of its fast decoder. Lengths differ between engines that sample differently (hf), so compare tokens/s.
Writes benchmarks/results/bench_engines_smollm2.json.
"""

from __future__ import annotations

import argparse
import glob
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

ENGINES = ("torch", "vllm", "sglang", "hf", "torch-model")
SIZES = {"quick": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, prompts=16, new=48),
         "full": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1376, prompts=32, new=128),
         "smollm2-gsm8k": dict(prompts=8, n=4, new=256)}


def run_job_worker(engine: str, model_dir: str, size: dict, out_path: str) -> None:
    """The smollm2-gsm8k generation: n seeded samples per chat prompt, to EOS, one timed call."""
    import torch

    from verl.utils.metrics import peak_memory_mb
    torch.set_num_threads(1)
    from verl.data import make_task
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout, engine_available
    from verl.rollout.tokenizer import Tokenizer
    name, decoder = ("torch", "model") if engine == "torch-model" else (engine, "fast")
    ok, why = engine_available(name)
    if not ok:
        json.dump({"engine": engine, "skipped": why}, open(out_path, "w"))
        return
    t0 = time.perf_counter()
    eng = build_rollout(RolloutConfig(engine=name, decoder=decoder, dtype="float32",
                                      max_batch_size=size["prompts"] * size["n"], kv_cache_memory_mb=1024),
                        model_path=model_dir)
    startup = time.perf_counter() - t0
    tok = Tokenizer.from_pretrained(model_dir)
    prompts = [tok.encode_prompt(r["prompt"]) for r in make_task("gsm_symbolic", size["prompts"], seed=0)]
    eng.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
    params = SamplingParams(n=size["n"], max_new_tokens=size["new"], temperature=1.0, seed=1234)
    t, cpu = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params)
    took, cpu = time.perf_counter() - t, time.process_time() - cpu
    lengths = [len(o.token_ids) for o in outs]
    json.dump({"engine": engine, "startup_s": startup, "generate_s": took, "tokens": sum(lengths),
               # this process's CPU seconds (vLLM's engine core runs in a process of its own: not counted)
               "cpu_s": cpu, "tokens_per_cpu_s": sum(lengths) / cpu,
               "tokens_per_s": sum(lengths) / took, "mean_length": sum(lengths) / len(lengths),
               "stopped_at_eos": sum(o.finish_reason == "stop" for o in outs) / len(outs),
               "peak_memory_mb": peak_memory_mb(), "sampled": [o.token_ids for o in outs]}, open(out_path, "w"))


def _prompts(n: int) -> list[str]:
    from verl.models.tiny import SAMPLE_TEXT
    words = " ".join(SAMPLE_TEXT).split()
    return [" ".join(words[(7 * i) % 50:(7 * i) % 50 + 3 + i % 9]) for i in range(n)]


def run_worker(engine: str, model_dir: str, size: dict, repeats: int, out_path: str) -> None:
    """One engine in this process: generate greedy and seeded samples, time them, write them as JSON."""
    import torch

    from verl.utils.metrics import peak_memory_mb
    torch.set_num_threads(1)
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout, engine_available
    ok, why = engine_available(engine)
    if not ok:
        json.dump({"engine": engine, "skipped": why}, open(out_path, "w"))
        return
    t0 = time.perf_counter()
    eng = build_rollout(RolloutConfig(engine=engine, dtype="float32", max_batch_size=size["prompts"],
                                      kv_cache_memory_mb=256), model_path=model_dir)
    startup = time.perf_counter() - t0
    prompts = _prompts(size["prompts"])
    greedy = SamplingParams(max_new_tokens=size["new"], temperature=0, ignore_eos=True, logprobs=True)
    seeded = SamplingParams(max_new_tokens=size["new"], temperature=1.0, seed=1234, ignore_eos=True, logprobs=True)
    eng.generate(prompts[:2], greedy)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = eng.generate(prompts, greedy)
        times.append(time.perf_counter() - t)
    sampled = eng.generate(prompts, seeded)
    tokens = sum(len(o.token_ids) for o in outs)
    json.dump({"engine": engine, "startup_s": startup, "generate_s": sum(times) / len(times), "tokens": tokens,
               "tokens_per_s": tokens * len(times) / sum(times), "peak_memory_mb": peak_memory_mb(),
               "greedy": [o.token_ids for o in outs], "sampled": [o.token_ids for o in sampled],
               "greedy_logprobs": [o.logprobs for o in outs]}, open(out_path, "w"))


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    return same / max(1, sum(max(len(x), len(y)) for x, y in zip(a, b)))


def _interpreter(engine: str, override: str | None) -> str:
    """This interpreter, unless the engine lives in its own environment (vLLM's) and is missing here."""
    if engine != "vllm":
        return sys.executable
    if override:
        return override
    try:
        import vllm  # noqa: F401
        return sys.executable
    except Exception:  # noqa: BLE001 - look for the project's vLLM environment instead
        cache = os.environ.get("VERL_CACHE", os.path.expanduser("~/.cache/verl"))
        found = sorted(glob.glob(os.path.join(cache, "venv-vllm-*", "bin", "python")), key=os.path.getmtime)
        return found[-1] if found else sys.executable


def _run(engine, python, model_dir, size, repeats, tmp) -> dict:
    out = os.path.join(tmp, f"{engine}.json")
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--model", model_dir, "--size-json",
           json.dumps(size), "--repeats", str(repeats), "--result", out]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"engine": engine, "skipped": f"failed (exit {proc.returncode}): {' | '.join(tail)}"}
    return json.load(open(out))


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in rows if "skipped" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar([r["engine"] for r in ran], [r["generate_s"] for r in ran], color="tab:blue")
    axes[0].set_ylabel("mean generate() time (s)")
    axes[0].set_title(title)
    x = range(len(ran))
    axes[1].bar([i - 0.2 for i in x], [100 * r["greedy_agreement"] for r in ran], 0.4, label="greedy")
    axes[1].bar([i + 0.2 for i in x], [100 * r["sampled_agreement"] for r in ran], 0.4, label="T=1, seeded")
    axes[1].set_xticks(list(x), [r["engine"] for r in ran])
    axes[1].set_ylim(0, 105)
    axes[1].set_ylabel("token agreement with torch (%)")
    axes[1].legend(loc="lower right")
    skipped = [f"{r['engine']}: skipped" for r in rows if "skipped" in r]
    if skipped:
        fig.text(0.01, 0.01, "; ".join(skipped), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 prompts x 48 tokens (default)")
    ap.add_argument("--full", action="store_true", help="32 prompts x 128 tokens, a bigger model")
    ap.add_argument("--workload", choices=["tiny", "smollm2-gsm8k"], default="tiny",
                    help="tiny: a random Llama, fixed-length (default); smollm2-gsm8k: the example job's generation")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES[:4]), choices=ENGINES)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="smollm2-gsm8k: below the job's 256 (faster)")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate() calls per engine")
    ap.add_argument("--vllm-python", default=None, help="interpreter of the vLLM environment (found if unset)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--size-json", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        size = json.loads(args.size_json)
        if "n" in size:
            run_job_worker(args.worker, args.model, size, args.result)
        else:
            run_worker(args.worker, args.model, size, args.repeats, args.result)
        return 0
    from verl.utils.results import RunInfo
    args.run_info = RunInfo.start()
    if args.workload == "smollm2-gsm8k":
        return job_main(args)
    size_name = "full" if args.full else "quick"
    size = SIZES[size_name]
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tmp = tempfile.mkdtemp(prefix="verl-bench-engines-")
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, seed=0, hidden_size=size["hidden"], num_layers=size["layers"],
                       num_heads=size["heads"], num_kv_heads=size["kv_heads"], intermediate_size=size["ffn"],
                       max_position_embeddings=512, initializer_range=0.2)
    model_dir = str(save_tiny(model, tok, os.path.join(tmp, "model")))
    engines = ["torch"] + [e for e in args.engines if e != "torch"]  # torch first: the reference
    rows = [_run(e, _interpreter(e, args.vllm_python), model_dir, size, args.repeats, tmp) for e in engines]
    ref = rows[0]
    for r in rows:
        if r["engine"] == "hf":
            r["note"] = "samples with transformers' own RNG stream, so seeded T=1 agreement is not expected"
        if "skipped" not in r and "skipped" not in ref:
            r["greedy_agreement"] = _agreement(ref["greedy"], r["greedy"])
            r["sampled_agreement"] = _agreement(ref["sampled"], r["sampled"])
            r["speedup_vs_torch"] = ref["generate_s"] / r["generate_s"]
    print(f"{'engine':8} {'generate s':>10} {'tokens/s':>9} {'start s':>8} {'peak MiB':>9} {'greedy agr':>10} "
          f"{'T=1 agr':>8}  ({size['prompts']} prompts x {size['new']} tokens)")
    for r in rows:
        if "skipped" in r:
            print(f"{r['engine']:8} skipped: {r['skipped']}")
        else:
            print(f"{r['engine']:8} {r['generate_s']:10.3f} {r['tokens_per_s']:9.0f} {r['startup_s']:8.1f} "
                  f"{r['peak_memory_mb']:9.0f} {100 * r.get('greedy_agreement', 0):9.1f}% "
                  f"{100 * r.get('sampled_agreement', 0):7.1f}%{'  (' + r['note'] + ')' if 'note' in r else ''}")
    import torch
    summary = [{k: v for k, v in r.items() if k not in ("greedy", "sampled", "greedy_logprobs")} for r in rows]
    res = {"benchmark": "engines", "size": size_name, "model": size, "rows": summary, "torch": torch.__version__,
           "machine": f"{platform.machine()} {os.cpu_count()} cores; 1 torch thread per engine"}
    from verl.utils.results import write_result
    write_result(os.path.join(args.out, "bench_engines.json"), res, args.run_info)
    _plot(rows, os.path.join(args.out, "bench_engines.png"),
          f"{size['prompts']} prompts x {size['new']} tokens, fp32, 1 thread")
    return 0


def job_main(args) -> int:
    """--workload smollm2-gsm8k: every engine on the example job's generation, in turn, one process each."""
    from verl.models.pretrained import resolve_model_path
    model_dir = str(resolve_model_path("smollm2-135m-instruct"))
    size = dict(SIZES["smollm2-gsm8k"], new=args.max_new_tokens or SIZES["smollm2-gsm8k"]["new"])
    tmp = tempfile.mkdtemp(prefix="verl-bench-engines-")
    rows = [_run(e, _interpreter(e, args.vllm_python), model_dir, size, 1, tmp) for e in args.engines]
    base = next((r for r in rows if r["engine"] == "torch" and "skipped" not in r), None)
    print(f"{'engine':12} {'generate s':>10} {'tokens':>7} {'tokens/s':>9} {'tok/CPU-s':>9} {'mean len':>8} "
          f"{'EOS %':>6} {'start s':>8} "
          f"({size['prompts']} prompts x {size['n']} samples, <= {size['new']} tokens to EOS, T=1)")
    for r in rows:
        if "skipped" in r:
            print(f"{r['engine']:12} skipped: {r['skipped']}")
            continue
        if base is not None:
            r["tokens_per_s_vs_torch"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["tokens_per_cpu_s_vs_torch"] = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
            r["sampled_agreement_with_torch"] = _agreement(base["sampled"], r["sampled"])
        print(f"{r['engine']:12} {r['generate_s']:10.1f} {r['tokens']:7d} {r['tokens_per_s']:9.1f} "
              f"{r['tokens_per_cpu_s']:9.1f} {r['mean_length']:8.1f} {100 * r['stopped_at_eos']:5.0f}% "
              f"{r['startup_s']:8.1f}")
    import torch
    res = {"benchmark": "engines", "workload": "smollm2-gsm8k", "model": "smollm2-135m-instruct (float32)",
           "job": size, "rows": [{k: v for k, v in r.items() if k != "sampled"} for r in rows],
           "torch": torch.__version__, "machine": f"{platform.machine()} {os.cpu_count()} cores; 1 torch thread "
           "per engine, engines run one after another"}
    from verl.utils.results import write_result
    write_result(os.path.join(args.out, "bench_engines_smollm2.json"), res, args.run_info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
