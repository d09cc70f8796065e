"""The actor update, and the critic's value pass and update, with plain packing and with prefix trees
(actor.share_prompt_prefix, critic.share_prompt_prefix), side by side, on real rollouts of the smollm2-gsm8k
example at 8 samples per prompt.

    python benchmarks/engines/bench_prefix_tree.py

SmolLM2-135M-Instruct (float32). The torch engine samples rollout.n=8 responses for each of 8 gsm_symbolic chat
prompts (temperature 1, seeded, up to 256 new tokens, stopping at EOS: the example's sampling, at n=8); that one
batch then goes through one actor update per side (PPO loss, one mini-batch of 64 responses, micro-batches of one
group: micro_batch_size=8), the sides interleaved `--reps` times, each from the same weights. The critic (a value
head on the same model, as `algorithm.adv_estimator=gae` builds it) then runs its value pass and one update (one
mini-batch, the same micro-batches) per side. Reported per side: wall and CPU seconds, the tokens its forward
computes (`actor/tree_token_ratio`, `critic/tree_token_ratio`), and the ratios; beside them the bound prompt-only
sharing puts on the token ratio at this shape (every response keeps its own tokens).
Writes benchmarks/results/bench_prefix_tree.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def rollouts(model, tok, n: int, max_new: int, prompts: int):
    """The example's rollout batch at n samples per prompt (torch engine, fast decoder) and its generate seconds."""
    from verl.data import make_task
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.workers.batch import batch_from_outputs
    rows = make_task("gsm_symbolic", prompts, seed=0)
    ids = [tok.encode_prompt(r["prompt"]) for r in rows]
    engine = build_rollout(RolloutConfig(engine="torch", max_batch_size=prompts * n), model=model, tokenizer=tok)
    t = time.perf_counter()
    outs = engine.generate(ids, SamplingParams(n=n, max_new_tokens=max_new, temperature=1.0, seed=1234,
                                               logprobs=True))
    return batch_from_outputs(outs, rows, n, max_new, tok.pad_token_id), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_prefix_tree.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    torch.set_num_threads(args.threads)
    from verl.config import ActorConfig, CriticConfig, OptimConfig
    from verl.distributed import init_placement
    from verl.models.pretrained import load_pretrained, resolve_model_path
    from verl.rollout.tokenizer import Tokenizer
    from verl.workers import ActorWorker, CriticWorker, TorchEngine, ValueModel
    from verl.workers.packing import tree_tokens
    model, hf_tok = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
    model.eval()
    tok = Tokenizer.wrap(hf_tok)
    batch, gen_s = rollouts(model, tok, args.n, args.max_new_tokens, args.prompts)
    print(f"[tree] rollouts: {len(batch)} responses in {gen_s:.0f} s", flush=True)
    adv = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    placement = init_placement("cpu")
    sides = {"packed": dict(share_prompt_prefix=False), "tree": dict(share_prompt_prefix=True)}
    times: dict[str, list] = {name: [] for name in sides}
    metrics: dict[str, dict] = {}
    returns = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    critic_times: dict[str, list] = {name: [] for name in sides}
    critic_metrics: dict[str, dict] = {}
    for _ in range(args.reps):
        for name, overrides in sides.items():
            cfg = ActorConfig(micro_batch_size=args.n, optim=OptimConfig(lr=2e-6), **overrides)
            engine = TorchEngine(copy.deepcopy(model).train(), OptimConfig(lr=2e-6), placement, head="lm",
                                 total_steps=5)
            actor = ActorWorker(engine, cfg, temperature=1.0, responses_per_mini=len(batch),
                                max_response_length=args.max_new_tokens)
            t, c = time.perf_counter(), time.process_time()
            stats = actor.update(batch, None, adv, None)  # on-policy, as the example runs
            times[name].append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c})
            metrics[name] = {k: v for k, v in stats.items() if k.startswith("actor/tree") or k == "actor/pg_loss"}
            print(f"[tree] {name}: {times[name][-1]}", flush=True)
        for name, overrides in sides.items():  # the critic: value pass + update, as a gae step runs them
            torch.manual_seed(7)  # the same value head on both sides
            vm = ValueModel.from_causal_lm(copy.deepcopy(model)).train()
            engine = TorchEngine(vm, OptimConfig(lr=1e-5), placement, head="value", total_steps=5)
            critic = CriticWorker(engine, CriticConfig(micro_batch_size=args.n, **overrides),
                                  responses_per_mini=len(batch))
            t, c = time.perf_counter(), time.process_time()
            values = critic.compute_values(batch)
            stats = critic.update(batch, values, returns)
            critic_times[name].append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c})
            critic_metrics[name] = {k: v for k, v in stats.items()
                                    if k.startswith("critic/tree") or k == "critic/vf_loss"}
            print(f"[tree] critic {name}: {critic_times[name][-1]}", flush=True)
    keep = batch.attention_mask.bool()
    P = batch.prompt_length
    prompt_tokens = int(keep[:, :P].sum())
    response_tokens = int(keep[:, P:].sum())
    distinct_prompts = prompt_tokens / args.n  # each prompt once
    tree, plain = tree_tokens(batch)
    by_group = [tree_tokens(batch.select(slice(g, g + args.n))) for g in range(0, len(batch), args.n)]
    mean = {name: {k: sum(t[k] for t in ts) / len(ts) for k in ("wall_s", "cpu_s")} for name, ts in times.items()}
    cmean = {name: {k: sum(t[k] for t in ts) / len(ts) for k in ("wall_s", "cpu_s")}
             for name, ts in critic_times.items()}
    res = {"model": "smollm2-135m-instruct (float32)", "responses": len(batch), "n": args.n,
           "prompt_tokens_mean": prompt_tokens / len(batch), "response_tokens_mean": response_tokens / len(batch),
           "generate_s": gen_s,
           "forward_tokens": {"packed": plain, "tree_per_group": sum(t for t, _ in by_group), "tree_whole_batch": tree},
           "token_ratio": plain / sum(t for t, _ in by_group),
           "token_ratio_bound_prompt_only": plain / (distinct_prompts + response_tokens),
           "packed": times["packed"], "tree": times["tree"], "metrics": metrics,
           "update_speedup_wall": mean["packed"]["wall_s"] / mean["tree"]["wall_s"],
           "update_speedup_cpu": mean["packed"]["cpu_s"] / mean["tree"]["cpu_s"],
           "critic": {"packed": critic_times["packed"], "tree": critic_times["tree"], "metrics": critic_metrics,
                      "token_ratio": critic_metrics["tree"].get("critic/tree_token_ratio"),
                      "speedup_wall": cmean["packed"]["wall_s"] / cmean["tree"]["wall_s"],
                      "speedup_cpu": cmean["packed"]["cpu_s"] / cmean["tree"]["cpu_s"],
                      "timed": "compute_values + update (one mini-batch of every response)"},
           "threads": args.threads,
           "differs": "nothing but actor.share_prompt_prefix / critic.share_prompt_prefix: same weights, batch, "
                      "advantages, returns, micro-batches"}
    write_result(args.out, res, run_info)
    print(json.dumps({k: v for k, v in res.items() if k not in ("packed", "tree")}, indent=1))


if __name__ == "__main__":
    main()
