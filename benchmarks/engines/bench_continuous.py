"""Continuous batching against waves in the torch engine's `generate`, side by side in one process: more rows than
rollout.max_batch_size (--prompts x --n rows in batches of --batch), responses ending at EOS at their own lengths,
the same seeds on both sides.

  waves        consecutive batches of --batch rows, each decoding until its longest row ends (the engine's schedule
               before continuous batching: `generate` called on one slice of prompts at a time, seeded so that every
               row samples the stream it samples in a single call)
  continuous   one `generate` call: once an eighth of the batch has finished, pending rows take the free slots

The model: SmolLM2-135M-Instruct on reasoning-gym gsm_symbolic prompts in its chat template (--model smollm2, the
default), or the tiny embedded Llama with a share of its vocabulary ending a row (--model tiny). Reported per
schedule: median seconds over --reps (the two alternate), generated tokens/s, the speed-up, and whether both
sampled the same tokens.

    python benchmarks/engines/bench_continuous.py                          # SmolLM2, 8 prompts x 8, batches of 16
    python benchmarks/engines/bench_continuous.py --model tiny --prompts 32 --reps 5

Writes benchmarks/results/bench_continuous.json (meta.command).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def setup(args):
    """(engine, prompt ids, sampling params) for --model."""
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    if args.model == "smollm2":
        from verl.data import make_task
        from verl.models.pretrained import load_pretrained, resolve_model_path
        from verl.rollout.tokenizer import Tokenizer
        model, hf_tok = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
        tok = Tokenizer(hf_tok)
        prompts = [tok.encode_prompt(r["prompt"]) for r in make_task("gsm_symbolic", args.prompts, seed=0)]
        stops: list[int] = []
    else:
        from verl.config import TinyModelConfig
        from verl.models.tiny import tiny_model, tiny_tokenizer
        hf_tok = tiny_tokenizer()
        model = tiny_model(TinyModelConfig(max_position_embeddings=1024), tokenizer=hf_tok, seed=0)
        tok = hf_tok
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 90, (int(torch.randint(8, 32, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(args.prompts)]
        stops = list(range(5, 7))  # 2 of ~96 ids end a row: lengths spread as EOS spreads them
    engine = build_rollout(RolloutConfig(engine="torch", max_batch_size=args.batch), model=model, tokenizer=tok)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1234,
                            stop_token_ids=stops)
    return engine, prompts, params


def waves(engine, prompts, params, batch: int):
    """The rows in consecutive batches of `batch`, each to its longest row; row (i, j) on seed + i n + j as in one
    call."""
    import dataclasses
    per = max(1, batch // params.n)
    outs = []
    for k in range(0, len(prompts), per):
        part = engine.generate(prompts[k:k + per], dataclasses.replace(params, seed=params.seed + k * params.n))
        outs += [dataclasses.replace(o, prompt_index=o.prompt_index + k) for o in part]
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--batch", type=int, default=16, help="rollout.max_batch_size")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_continuous.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    torch.set_num_threads(args.threads)
    engine, prompts, params = setup(args)
    if args.batch % args.n or args.batch >= len(prompts) * args.n:
        ap.error(f"--batch must be a multiple of --n below --prompts x --n = {len(prompts) * args.n}")
    sides = {"waves": lambda: waves(engine, prompts, params, args.batch),
             "continuous": lambda: engine.generate(prompts, params)}
    times: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, list[list[int]]] = {}
    joins = 0.0
    for rep in range(args.reps):
        for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            engine.take_metrics()
            t = time.perf_counter()
            outs = sides[side]()
            times[side].append(time.perf_counter() - t)
            if side == "continuous":
                joins = engine.take_metrics().get("rollout/continuous_joins", 0.0)
            tokens[side] = [o.token_ids for o in sorted(outs, key=lambda o: (o.prompt_index, o.sample_index))]
            print(f"rep {rep} {side:10s} {times[side][-1]:.2f} s", flush=True)
    generated = sum(len(t) for t in tokens["continuous"])
    rows = []
    for side in sides:
        sec = statistics.median(times[side])
        rows.append({"schedule": side, "seconds": sec, "tokens_per_s": sum(len(t) for t in tokens[side]) / sec,
                     "generated_tokens": sum(len(t) for t in tokens[side]), "runs_s": times[side]})
    rows[1]["speedup"] = rows[0]["seconds"] / rows[1]["seconds"]
    rows[1]["joins"] = joins
    same = sum(a == b for a, b in zip(tokens["waves"], tokens["continuous"]))
    lengths = [len(t) for t in tokens["continuous"]]
    for r in rows:
        print(f"{r['schedule']:10s} {r['seconds']:.2f} s  {r['tokens_per_s']:.0f} tok/s  "
              f"{r.get('speedup', 1.0):.2f}x", flush=True)
    print(f"rows sampling the same tokens on both sides: {same} of {len(lengths)}; response lengths "
          f"{min(lengths)}..{max(lengths)} (mean {statistics.fmean(lengths):.0f})")
    meta = {"model": args.model, "prompts": len(prompts), "n": args.n, "max_batch_size": args.batch,
            "max_new_tokens": args.max_new_tokens, "reps": args.reps, "threads": args.threads,
            "rows_same_tokens": same, "rows": len(lengths), "generated_tokens": generated,
            "response_length": {"min": min(lengths), "max": max(lengths), "mean": statistics.fmean(lengths)},
            "note": "one process; both schedules sample every row from the same seed; rows that differ between "
                    "them (batch-shape rounding flipping a sample) are counted in rows_same_tokens"}
    write_result(args.out, {"meta": meta, "rows": rows}, run)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
