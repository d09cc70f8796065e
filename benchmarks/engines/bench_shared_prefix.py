"""The update pass with and without actor.share_prompt_prefix on the smollm2-gsm8k job's shapes, side by side.

    python benchmarks/engines/bench_shared_prefix.py --reps 1

SmolLM2-135M-Instruct (float32, one thread), the job's 8 gsm_symbolic chat prompts x 4 responses of random tokens
(40% at the 256-token limit, the rest 60-250: the shape of the job's rollouts), micro-batches of one group (4),
packed; one actor update per configuration, interleaved (packed then shared, `--reps` times). Reported: wall
and CPU seconds per update, and the prompt share of the update's tokens. Writes
benchmarks/results/bench_shared_prefix.json.
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


def rollout_like_batch(prompts: list[list[int]], n: int, max_new: int, seed: int = 0):
    from verl.workers.batch import RolloutBatch
    g = torch.Generator().manual_seed(seed)
    B = len(prompts) * n
    lens = [max_new if torch.rand(1, generator=g).item() < 0.4 else int(torch.randint(60, 250, (1,), generator=g))
            for _ in range(B)]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(B, P + max_new, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i in range(B):
        p = prompts[i // n]
        ids[i, P - len(p):P], attn[i, P - len(p):P] = torch.tensor(p), 1
        ids[i, P:P + lens[i]] = torch.randint(3, 49000, (lens[i],), generator=g)
        attn[i, P:P + lens[i]] = 1
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=attn[:, P:].float(), group=torch.arange(B) // n), lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_shared_prefix.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    torch.set_num_threads(1)
    from verl.config import ActorConfig, OptimConfig
    from verl.data import make_task
    from verl.distributed import init_placement
    from verl.models.pretrained import load_pretrained, resolve_model_path
    from verl.rollout.tokenizer import Tokenizer
    from verl.workers import ActorWorker, TorchEngine
    model, hf_tok = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
    tok = Tokenizer.wrap(hf_tok)
    prompts = [tok.encode_prompt(r["prompt"]) for r in make_task("gsm_symbolic", 8, seed=0)]
    batch, lens = rollout_like_batch(prompts, 4, 256)
    adv = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    placement = init_placement("cpu")
    times: dict[str, list] = {"packed": [], "shared": []}
    for _ in range(args.reps):
        for name in ("packed", "shared"):
            cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=2e-6), share_prompt_prefix=name == "shared")
            engine = TorchEngine(copy.deepcopy(model), OptimConfig(lr=2e-6), placement, head="lm", total_steps=5)
            actor = ActorWorker(engine, cfg, temperature=1.0, responses_per_mini=len(batch), max_response_length=256)
            t, c = time.perf_counter(), time.process_time()
            actor.update(batch, None, adv, None)
            times[name].append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c})
            print(name, times[name][-1], flush=True)
    prompt_tokens = 4 * sum(map(len, prompts))
    res = {"prompt_tokens_mean": prompt_tokens / len(batch), "response_tokens_mean": sum(lens) / len(lens),
           "prompt_share_of_update_tokens": prompt_tokens / (prompt_tokens + sum(lens)), **times,
           "speedup_cpu": sum(t["cpu_s"] for t in times["packed"]) / sum(t["cpu_s"] for t in times["shared"])}
    write_result(args.out, res, run_info)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
