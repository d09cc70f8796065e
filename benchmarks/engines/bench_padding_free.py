"""Padding-free training against the padded batch, side by side in one process: the actor's log-prob pass
(`compute_log_probs`) and its PPO update (forward + backward + optimizer step) on a batch whose responses have
very different lengths (uniform in [--min-response, --max-response] tokens, right-padded to the longest, as a
rollout with EOS gives them), on the plain-torch engine.

Rows (interleaved: every repeat runs each row once, in turn, so machine noise hits all rows alike):
  padded          micro_batch_size responses per micro-batch, padded to the batch's [P + R] columns
  packed          the same micro-batches, packed (actor.padding_free=true)
  packed+budget   packed micro-batches filled to actor.max_tokens_per_micro_batch real tokens
Reported per row: median seconds of each pass, speed-up over padded, and the share of the positions it
computes that are padding.

    python benchmarks/engines/bench_padding_free.py                 # 32 responses of 5..128 tokens
    python benchmarks/engines/bench_padding_free.py --repeats 7 --threads 2
Writes benchmarks/results/bench_padding_free.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def make_batch(args):
    """Prompts of 8..24 tokens, responses uniform in [min, max] tokens, in RolloutBatch's padded layout."""
    import torch

    from verl.workers.batch import RolloutBatch
    g = torch.Generator().manual_seed(0)
    B, R = args.responses, args.max_response
    prompts = torch.randint(8, 25, (B,), generator=g).tolist()
    responses = torch.randint(args.min_response, args.max_response + 1, (B,), generator=g).tolist()
    P = max(prompts)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - p:P + r] = torch.randint(3, args.vocab, (p + r,), generator=g)
        attn[b, P - p:P + r] = 1
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=attn[:, P:].float(), group=torch.arange(B) // 4)


def rows(args) -> dict[str, dict]:
    return {"padded": dict(padding_free=False),
            "packed": dict(padding_free=True),
            "packed+budget": dict(padding_free=True, max_tokens_per_micro_batch=args.max_tokens)}


def run(args) -> dict:
    import torch

    from verl.config import ActorConfig, OptimConfig, TinyModelConfig
    from verl.distributed import init_placement
    from verl.models.tiny import tiny_model
    from verl.workers import ActorWorker, TorchEngine
    from verl.workers.packing import micro_batch_slices, padded_token_share
    torch.set_num_threads(args.threads)
    shape = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                            num_kv_heads=args.heads // 2, intermediate_size=args.hidden * 3,
                            max_position_embeddings=512, vocab_size=args.vocab)
    model = tiny_model(shape, seed=0)
    placement = init_placement("cpu")
    engine = TorchEngine(model, OptimConfig(lr=1e-6), placement, total_steps=10 ** 6)
    batch = make_batch(args)
    adv = torch.randn(len(batch), 1) * batch.response_mask
    workers = {name: ActorWorker(engine, ActorConfig(micro_batch_size=args.micro_batch_size, optim=OptimConfig(),
                                                     **cfg),
                                 temperature=1.0, responses_per_mini=len(batch), max_response_length=args.max_response)
               for name, cfg in rows(args).items()}
    times: dict[str, dict[str, list[float]]] = {n: {"log_prob_s": [], "update_s": []} for n in workers}
    for rep in range(args.repeats + 1):          # the first round warms up and is not counted
        for name, worker in workers.items():
            t0 = time.perf_counter()
            lp, _ = worker.compute_log_probs(batch)
            t1 = time.perf_counter()
            worker.update(batch, lp, adv, None)
            t2 = time.perf_counter()
            if rep:
                times[name]["log_prob_s"].append(t1 - t0)
                times[name]["update_s"].append(t2 - t1)
    real = batch.num_tokens()
    out = {}
    for name, cfg in rows(args).items():
        slices = micro_batch_slices(batch, args.micro_batch_size, cfg.get("max_tokens_per_micro_batch", 0))
        med = {k: statistics.median(v) for k, v in times[name].items()}
        out[name] = {**med, "micro_batches": len(slices), "real_tokens": real,
                     "padded_share": 0.0 if cfg["padding_free"] else padded_token_share(batch, slices)}
    for name in out:
        for k in ("log_prob_s", "update_s"):
            out[name][k.replace("_s", "_speedup")] = out["padded"][k] / out[name][k]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=32)
    ap.add_argument("--min-response", type=int, default=5)
    ap.add_argument("--max-response", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=768, help="token budget of the packed+budget row")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_padding_free.json"))
    args = ap.parse_args(argv)
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    res = run(args)
    print(f"{'row':<15}{'log-prob s':>11}{'x':>6}{'update s':>10}{'x':>6}{'micro':>7}{'padded':>8}")
    for name, r in res.items():
        print(f"{name:<15}{r['log_prob_s']:>11.3f}{r['log_prob_speedup']:>6.2f}{r['update_s']:>10.3f}"
              f"{r['update_speedup']:>6.2f}{r['micro_batches']:>7}{r['padded_share']:>8.1%}")
    write_result(args.out, {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": res}, run_info,
                 processor=platform.processor() or platform.machine())


if __name__ == "__main__":
    main()
