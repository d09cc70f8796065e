"""Rollout throughput and agreement: the torch engine vs the vLLM engine on the same prompts and weights.

Both engines run a local random Llama (float32, no hub) on one CPU thread each (vLLM's in-process CPU mode
pins torch to one thread, so the torch engine gets the same), with `ignore_eos` so that every sample has
exactly `max_new_tokens` tokens. Reported side by side:
  tokens/s        generated tokens / wall time of one generate() call over all prompts (after a warm-up)
  greedy agreement              fraction of positions where the two engines pick the same token
  temperature-1 agreement       the same at temperature 1 with a fixed seed (shared seeding convention:
                                per-sample seed, float64 exponential race — see verl.rollout.base)
  logprob |diff|                mean absolute difference of the returned per-token log-probs

Runs under the vLLM venv (requirements/vllm.txt):
    /root/.cache/verl-vllm/bin/python benchmarks/rollout/bench_rollout.py           # --quick (default)
    /root/.cache/verl-vllm/bin/python benchmarks/rollout/bench_rollout.py --full
Writes benchmarks/results/bench_rollout.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

SIZES = {"quick": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, prompts=16, new=48),
         "full": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1376, prompts=32, new=128)}


def _prompts(tok, n):
    from verl.testing.tiny import SAMPLE_TEXT
    words = " ".join(SAMPLE_TEXT).split()
    return [" ".join(words[(7 * i) % 50:(7 * i) % 50 + 3 + i % 9]) for i in range(n)]


def _agreement(a, b):
    same = sum(p == q for x, y in zip(a, b) for p, q in zip(x.token_ids, y.token_ids))
    total = sum(max(len(x.token_ids), len(y.token_ids)) for x, y in zip(a, b))
    return same / total


def _lp_diff(a, b):
    d = [abs(p - q) for x, y in zip(a, b) for p, q, s, t in zip(x.logprobs, y.logprobs, x.token_ids, y.token_ids)
         if s == t]
    return sum(d) / max(1, len(d))


def _timed(engine, prompts, sp):
    engine.generate(prompts[:2], sp)  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return outs, sum(len(o.token_ids) for o in outs) / dt, dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    size = "full" if args.full else "quick"
    cfg = SIZES[size]
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.testing.tiny import save_tiny, tiny_model, tiny_tokenizer
    from verl.rollout.vllm_engine import vllm_available
    ok, why = vllm_available()
    if not ok:
        sys.exit(f"bench_rollout needs vLLM: {why}")
    tok = tiny_tokenizer()
    model = tiny_model(tokenizer=tok, seed=0, hidden_size=cfg["hidden"], num_layers=cfg["layers"],
                       num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"], intermediate_size=cfg["ffn"],
                       max_position_embeddings=512, initializer_range=0.2)
    path = str(save_tiny(model, tok, tempfile.mkdtemp(prefix="verl-bench-rollout-")))
    torch.set_num_threads(1)
    torch_engine = build_rollout(RolloutConfig(engine="torch", model_path=path, max_batch_size=cfg["prompts"]))
    prompts = _prompts(torch_engine.tokenizer, cfg["prompts"])
    greedy = SamplingParams(max_new_tokens=cfg["new"], temperature=0, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(max_new_tokens=cfg["new"], temperature=1.0, seed=1234, ignore_eos=True, logprobs=True)
    t_greedy, t_tps, t_dt = _timed(torch_engine, prompts, greedy)
    t_sampled = torch_engine.generate(prompts, sampled)
    t0 = time.perf_counter()
    vllm_engine = build_rollout(RolloutConfig(engine="vllm", model_path=path, dtype="float32",
                                              kv_cache_memory_bytes=256 << 20, max_batch_size=cfg["prompts"]))
    startup = time.perf_counter() - t0
    v_greedy, v_tps, v_dt = _timed(vllm_engine, prompts, greedy)
    v_sampled = vllm_engine.generate(prompts, sampled)
    res = dict(
        benchmark="rollout", size=size, model=cfg, params=sum(p.numel() for p in torch_engine.model.parameters()),
        torch_tokens_per_s=t_tps, vllm_tokens_per_s=v_tps, speedup_vllm_over_torch=v_tps / t_tps,
        torch_latency_s=t_dt, vllm_latency_s=v_dt, vllm_startup_s=startup,
        greedy_agreement=_agreement(t_greedy, v_greedy), temp1_seeded_agreement=_agreement(t_sampled, v_sampled),
        greedy_logprob_abs_diff=_lp_diff(t_greedy, v_greedy), temp1_logprob_abs_diff=_lp_diff(t_sampled, v_sampled),
        tokens=sum(len(o.token_ids) for o in t_greedy),
        machine=f"{platform.machine()} {os.cpu_count()} cores, shared; 1 torch thread per engine",
        torch=torch.__version__, vllm=__import__("vllm").__version__, command=" ".join(sys.argv))
    print(json.dumps(res, indent=2))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_rollout.json"), "w") as f:
        json.dump(res, f, indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(["torch", "vLLM"], [t_tps, v_tps], color=["tab:blue", "tab:orange"])
    axes[0].set_ylabel("generated tokens / s")
    axes[0].set_title(f"{cfg['prompts']} prompts x {cfg['new']} tokens ({res['params'] / 1e6:.1f}M params, fp32)")
    axes[1].bar(["greedy", "T=1, seed"], [res["greedy_agreement"] * 100, res["temp1_seeded_agreement"] * 100])
    axes[1].set_ylim(0, 105)
    axes[1].set_ylabel("token agreement torch vs vLLM (%)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_rollout.png"), dpi=110)


if __name__ == "__main__":
    main()
