"""MoE weight sync: the 3D-HybridEngine against a full gather, for a mixture-of-experts actor trained with expert
parallelism (EP=2 over 2 processes) and generated at rollout TP 1 on the same ranks (each rank a whole replica).

Each rank holds the attention, norms and router whole and half of every MoE layer's experts. Every repeat times
both transfers into the same torch rollout engine, interleaved (`bench_transition.py`'s method):
  full gather   the whole model gathered to rank 0 (experts over the EP group), broadcast to every rank, loaded
                whole: `RolloutWorker._full_gather`
  hybrid        the planned, bucketed reshard: each rank keeps what it holds and receives only the experts the
                other EP rank holds (`RolloutWorker.sync_weights`)
Reported: median seconds of each and their ratio, bytes received per rank, and that both leave the same greedy
generation.

    python benchmarks/reshard/bench_moe_sync.py            # Qwen3-MoE-style, 8 experts, ~30M parameters
Writes benchmarks/results/bench_moe_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = dict(family="qwen3_moe", hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=768,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384, vocab_size=8000)


def worker(model_dir: str, ep: int, repeats: int, out: str) -> None:
    import torch
    from types import SimpleNamespace

    from verl.config import MegatronConfig
    from verl.distributed import init_placement
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.workers import RolloutWorker
    from verl.workers.megatron import MegatronEngine
    torch.set_num_threads(1)
    placement = init_placement("cpu", ep=ep, megatron=True)
    actor = SimpleNamespace(engine=MegatronEngine(model_dir, placement, MegatronConfig(ep=ep)))
    cfg = RolloutConfig(engine="torch", tp=1, dtype="float32", max_batch_size=8)
    rollout = RolloutWorker(build_rollout(cfg, model_path=model_dir), cfg, max_prompt_length=32, placement=placement)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    times, rows, tokens = {"full": [], "hybrid": []}, {}, {}
    rollout.sync_weights(actor)  # plans the hybrid engine (once, collective)
    for _ in range(repeats):
        for name in ("full", "hybrid"):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            rows[name] = rollout._full_gather(actor) if name == "full" else rollout.sync_weights(actor)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [o.token_ids for o in rollout.engine.generate(["the quick brown fox"], greedy)]
    hybrid = rollout._hybrid
    received = hybrid.plan.traffic()["received"]
    result = {"processes": placement.world_size, "ep": ep, "rollout_tp": 1,
              "full_gather_s": statistics.median(times["full"]), "hybrid_s": statistics.median(times["hybrid"]),
              "hybrid_received_bytes_per_rank": received, "engine_bytes": rows["hybrid"]["perf/sync_bytes"],
              "full_gather_bytes": rows["full"]["perf/full_gather_bytes"],
              "same_generation": tokens["full"] == tokens["hybrid"],
              "params": sum(p.numel() for p in rollout.engine.model.parameters())}
    if placement.is_main:
        json.dump(result, open(out, "w"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_moe_sync.json"))
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    if args.worker:
        model_dir, ep, out = args.worker
        worker(model_dir, int(ep), args.repeats, out)
        return 0
    from verl.config import TinyModelConfig
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tmp = tempfile.mkdtemp(prefix="verl-bench-moe-sync-")
    model = tiny_model(TinyModelConfig(**MODEL, max_position_embeddings=256), seed=0)
    model_dir = str(save_tiny(model, tiny_tokenizer(), os.path.join(tmp, "model")))
    out = os.path.join(tmp, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), "--repeats", str(args.repeats), "--worker", model_dir, "2", out]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not os.path.exists(out):
        print(proc.stderr[-3000:])
        return 1
    r = json.load(open(out))
    r["hybrid_over_full_gather"] = r["hybrid_s"] / r["full_gather_s"]
    print(f"EP=2 -> rollout TP 1 ({r['params'] / 1e6:.1f}M parameters): full gather {r['full_gather_s'] * 1e3:.1f} ms, "
          f"hybrid {r['hybrid_s'] * 1e3:.1f} ms ({r['hybrid_over_full_gather']:.1%} of it); received per rank "
          f"{[round(b / 2**20, 2) for b in r['hybrid_received_bytes_per_rank']]} MiB of "
          f"{r['engine_bytes'] / 2**20:.1f} MiB; same generation: {r['same_generation']}")
    meta = {"model": MODEL, "repeats": args.repeats,
            "machine": f"{platform.machine()} {os.cpu_count()} cores; 1 thread per rank"}
    write_result(args.out, {"meta": meta, "rows": [r]}, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
