"""The torch engine's decode step at three points of its history, side by side in one process on the example
job's generation.

  filed    as it was when issue 30 asked for 2x: projections through F.linear (`LlamaFamilyDecoder(pack="none")`),
           every sampling step's Exp(1) noise drawn with `exponential_` (a logarithm per vocabulary entry), one
           query per head through SDPA's grouped-query path (`group_queries=False`)
  prev     the defaults before verl's decode kernels: projections packed for oneDNN (`pack="onednn"`), the race
           from uniform draws with the logarithm taken only where a token can still win (verl.rollout.torch_engine),
           and each key/value head's query heads attending side by side (`group_queries=True`) through SDPA
  now      the defaults: as prev, with the projections packed for verl's kernel (`pack="auto"`:
           verl.ops.packed_linear where verl._C is built) and the attention through verl's decode kernel
           (`fused_attention=True`, verl.ops.decode_attention)

The work: SmolLM2-135M-Instruct (float32), examples/smollm2_gsm8k.yaml's generation (8 gsm_symbolic chat prompts x
4 samples, temperature 1, seeded, one torch thread, --max-new-tokens 256), on the same loaded weights, the sides
alternating (filed, prev, now, filed, ...) so that machine load hits all alike. Two parts:

  equal   `ignore_eos`: every row decodes --max-new-tokens tokens on every side (32 rows all the way), so all do
          the same work; how many samples are the same as the filed side's is reported (the race draws what
          `exponential_` draws; packed products are within rounding of F.linear's, and a rounding that flips a
          sampled token changes that sample from there on)
  eos     the example as it runs: rows end at <|im_end|> and leave the batch, so the tail decodes fewer rows;
          tokens/s of each side and how many samples are identical (the work may differ where a sample did)
  steps   the decode step alone, paired: one decoder per side over the same weights, prefilled with the same
          --rows x (the example's prompt width) token ids, then --max-new-tokens - 1 decode steps whose calls
          alternate side by side step after step (a drift of the machine's speed, which on these shared machines
          moves a whole generate by 10-20%, lands on all sides alike); seconds per side at each row count

    python benchmarks/engines/bench_decode.py                     # all three parts, 1 repeat
    python benchmarks/engines/bench_decode.py --parts equal --repeats 2
    python benchmarks/engines/bench_decode.py --parts steps --rows 32 8

Writes benchmarks/results/bench_decode.json (meta.command).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# side -> (LlamaFamilyDecoder.pack, .group_queries, the uniform race, .fused_attention)
SIDES = {"filed": ("none", False, False, False), "prev": ("onednn", True, True, False),
         "now": ("auto", True, True, True)}


def run(args) -> dict:
    import torch

    import verl.rollout.torch_engine as torch_engine
    from verl.data import make_task
    from verl.models.pretrained import load_pretrained, resolve_model_path
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.rollout.tokenizer import Tokenizer
    torch.set_num_threads(1)
    model, hf_tok = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
    tok = Tokenizer(hf_tok)
    prompts = [tok.encode_prompt(r["prompt"]) for r in make_task("gsm_symbolic", 8, seed=0)]
    engine = build_rollout(RolloutConfig(engine="torch", max_batch_size=32), model=model, tokenizer=tok)
    fast = engine._fast
    if fast is None:
        raise SystemExit("the torch engine does not run its fast decoder on this model")
    race = torch_engine._cpu_exponential_is_log1p()
    res = {"model": "smollm2-135m-instruct (float32)", "torch": torch.__version__,
           "packing_now": fast.packing, "pack_unavailable": fast.pack_unavailable, "race_from_uniforms": race,
           "job": {"prompts": len(prompts), "n": 4, "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                   "threads": 1, "repeats": args.repeats},
           "sides": {side: f"pack={pack}{f' ({fast.packing})' if pack == 'auto' else ''}, "
                           f"{'uniform race' if uniform else 'exponential_'}, group_queries={group}, "
                           f"fused_attention={fused}"
                     for side, (pack, group, uniform, fused) in SIDES.items()},
           "differs": "only the decode step's code paths named in sides; same weights, prompts, seeds, sampling "
                      "settings"}

    def use(side: str) -> None:
        fast.pack, fast.group_queries, uniform, fast.fused_attention = SIDES[side]
        torch_engine._exponential_checked[:] = [race and uniform]

    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
    for part in [p for p in args.parts if p != "steps"]:
        params = SamplingParams(n=4, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1234,
                                ignore_eos=part == "equal")
        rows = {s: {"generate_s": [], "tokens": []} for s in SIDES}
        outs = {}
        for r in range(args.repeats):
            for side in SIDES:
                use(side)
                t = time.perf_counter()
                outs[side] = engine.generate(prompts, params)
                rows[side]["generate_s"].append(time.perf_counter() - t)
                rows[side]["tokens"].append(sum(len(o.token_ids) for o in outs[side]))
                print(f"[decode] {part} repeat {r} {side}: {rows[side]['generate_s'][-1]:.1f} s, "
                      f"{rows[side]['tokens'][-1]} tokens", flush=True)
        for side in SIDES:
            row = rows[side]
            row["tokens_per_s"] = statistics.median(n / s for n, s in zip(row["tokens"], row["generate_s"]))
            row["identical_to_filed"] = sum(a.token_ids == b.token_ids for a, b in zip(outs[side], outs["filed"]))
        res[part] = {"ignore_eos": part == "equal", **rows, "samples": len(outs["now"]),
                     "speedup_now_over_filed": rows["now"]["tokens_per_s"] / rows["filed"]["tokens_per_s"],
                     "speedup_now_over_prev": rows["now"]["tokens_per_s"] / rows["prev"]["tokens_per_s"],
                     "speedup_prev_over_filed": rows["prev"]["tokens_per_s"] / rows["filed"]["tokens_per_s"]}
        print(f"[decode] {part}: tokens/s " + ", ".join(f"{s} {rows[s]['tokens_per_s']:.1f}" for s in SIDES) +
              f"; now {res[part]['speedup_now_over_filed']:.2f}x filed, {res[part]['speedup_now_over_prev']:.2f}x prev",
              flush=True)
    use("now")
    if "steps" in args.parts:
        res["steps"] = paired_steps(model, max(map(len, prompts)), args)
    return res


def paired_steps(model, width: int, args) -> dict:
    """The decode step alone at each of --rows, the sides' calls alternating step by step (module docstring)."""
    import torch

    from verl.rollout.fast_decoder import LlamaFamilyDecoder
    out = {"prompt_width": width, "decode_steps": args.max_new_tokens - 1, "rows": {}}
    for rows in args.rows:
        decoders = {}
        for side, (pack, group, _, fused) in SIDES.items():
            dec = LlamaFamilyDecoder(model, pack=pack)
            dec.group_queries, dec.fused_attention = group, fused
            dec.start(rows, width + args.max_new_tokens)
            decoders[side] = dec
        ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(rows, width + args.max_new_tokens, dtype=torch.long)
        for dec in decoders.values():
            dec.step(ids, mask[:, :width])
        token = ids[:, -1:]
        seconds = dict.fromkeys(SIDES, 0.0)
        for _ in range(args.max_new_tokens - 1):
            for side, dec in decoders.items():
                t = time.perf_counter()
                dec.step(token, mask[:, :dec.length + 1])
                seconds[side] += time.perf_counter() - t
        for dec in decoders.values():
            dec.finish()
        out["rows"][str(rows)] = {"seconds": seconds, "now_over_filed": seconds["filed"] / seconds["now"],
                                  "now_over_prev": seconds["prev"] / seconds["now"]}
        print(f"[decode] steps at {rows} rows: " + ", ".join(f"{s} {v:.1f} s" for s, v in seconds.items()) +
              f"; now {seconds['filed'] / seconds['now']:.2f}x filed, {seconds['prev'] / seconds['now']:.2f}x prev",
              flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("equal", "eos", "steps"), default=["equal", "eos", "steps"])
    ap.add_argument("--rows", nargs="+", type=int, default=[32, 21, 8],
                    help="steps: the row counts (the example's 32 rows, and fewer as rows end)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_decode.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    info = RunInfo.start()
    res = run(args)
    write_result(args.out, {"benchmark": "decode", **res}, info)
    print(f"[decode] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
