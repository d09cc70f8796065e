"""The seed article's transition figure: the time a PPO step spends moving the actor's weights to generation,
3D-HybridEngine against the full-gather path it replaced, in the same run.

For each layout a megatron actor (TP × PP × DP over the processes) and a rollout engine at rollout.tp run under
torchrun; every repeat times both transfers into the same engine, interleaved:
  full gather   the whole model gathered to the replica's first rank, broadcast to its TP × PP peers, loaded
                whole (the engine's loader shards it) — `RolloutWorker._full_gather`, what verl train did before
  hybrid        the lazy, bucketed reshard from the local shards straight into the generation layout
                (`RolloutWorker.sync_weights`), in the engine's own format (vLLM's fused per-rank shards at TP > 1)
Reported per layout: median seconds of each, the ratio, bytes moved between ranks, peak extra memory, and a
check that both transfers leave identical generation (greedy tokens after each).

    python benchmarks/reshard/bench_transition.py                 # 2 and 4 processes, ~134M parameters
    python benchmarks/reshard/bench_transition.py --quick         # a ~20M model, 2 processes
Runs with the vLLM environment when it exists (`bash scripts/setup_env.sh vllm`; rollout.tp > 1 needs vLLM),
else with the torch engine (rollout.tp = 1 layouts only). Writes benchmarks/results/bench_transition.{json,png}.
"""

from __future__ import annotations

import argparse
import glob
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

MODELS = {"full": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                       vocab_size=32000),
          "quick": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688,
                        vocab_size=32000)}
# (processes, training TP, rollout.tp): the megatron layouts, on 2 and 4 processes
LAYOUTS = {"full": [(2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 2, 2)], "quick": [(2, 2, 1), (2, 2, 2)]}


def worker(model_dir: str, tp: int, tp_g: int, engine: str, repeats: int, out: str) -> None:
    """One rank: a frozen megatron actor, a rollout engine, both transfers timed alternately."""
    import torch
    from types import SimpleNamespace

    from verl.config import MegatronConfig
    from verl.distributed import init_placement
    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    from verl.workers import RolloutWorker
    from verl.workers.megatron import MegatronEngine
    torch.set_num_threads(1)
    placement = init_placement("cpu", tp=tp, megatron=True, process_group=True)
    actor = SimpleNamespace(engine=MegatronEngine(model_dir, placement, MegatronConfig(tp=tp)))
    cfg = RolloutConfig(engine=engine, tp=tp_g, dtype="float32", kv_cache_memory_mb=128, max_batch_size=8)
    rollout = RolloutWorker(build_rollout(cfg, model_path=model_dir), cfg, max_prompt_length=32, placement=placement)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    rows, times, tokens = [], {"full": [], "hybrid": []}, {}
    rollout.sync_weights(actor)  # plans the hybrid engine (once, collective)
    for _ in range(repeats):
        for name in ("full", "hybrid"):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            m = rollout._full_gather(actor) if name == "full" else rollout.sync_weights(actor)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
            rows.append(m)
            tokens[name] = [o.token_ids for o in rollout.engine.generate(["the quick brown fox"], greedy)]
    last = rows[-1]
    result = {"processes": placement.world_size, "tp": tp, "rollout_tp": tp_g, "engine": engine,
              "full_gather_s": statistics.median(times["full"]), "hybrid_s": statistics.median(times["hybrid"]),
              "hybrid_comm_bytes": last["perf/sync_comm_bytes"], "hybrid_peak_bytes": last["perf/sync_peak_bytes"],
              "engine_bytes": last["perf/sync_bytes"], "full_gather_bytes": rows[-2]["perf/full_gather_bytes"],
              "same_generation": tokens["full"] == tokens["hybrid"],
              "params": sum(p.numel() for p in actor.engine.model.gpt.parameters()) * placement.tp_size}
    if placement.is_main:
        json.dump(result, open(out, "w"))
    rollout.engine.close()


def _python(engine: str) -> str:
    if engine == "torch":
        return sys.executable
    cache = os.environ.get("VERL_CACHE", os.path.expanduser("~/.cache/verl"))
    found = sorted(glob.glob(os.path.join(cache, "venv-vllm-*", "bin", "python")), key=os.path.getmtime)
    return found[-1]


def _vllm_env() -> bool:
    cache = os.environ.get("VERL_CACHE", os.path.expanduser("~/.cache/verl"))
    return bool(glob.glob(os.path.join(cache, "venv-vllm-*", "bin", "python")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~20M model, 2 processes")
    ap.add_argument("--full", action="store_true", help="~134M parameters, 2 and 4 processes (default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model_dir, tp, tp_g, engine, out = args.worker
        worker(model_dir, int(tp), int(tp_g), engine, args.repeats, out)
        return 0
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    size = "quick" if args.quick else "full"
    from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
    tmp = tempfile.mkdtemp(prefix="verl-bench-transition-")
    model = tiny_model(tokenizer=None, seed=0, max_position_embeddings=256, **MODELS[size])
    model_dir = str(save_tiny(model, tiny_tokenizer(), os.path.join(tmp, "model")))
    engine = "vllm" if _vllm_env() else "torch"
    rows = []
    for nproc, tp, tp_g in LAYOUTS[size]:
        if tp_g > 1 and engine != "vllm":
            rows.append({"processes": nproc, "tp": tp, "rollout_tp": tp_g, "skipped": "rollout.tp > 1 needs vLLM"})
            continue
        out = os.path.join(tmp, f"r{nproc}_{tp}_{tp_g}.json")
        torchrun = os.path.join(os.path.dirname(_python(engine)), "torchrun")
        cmd = [torchrun, f"--nproc_per_node={nproc}", os.path.abspath(__file__), "--repeats", str(args.repeats),
               "--worker", model_dir, str(tp), str(tp_g), engine, out]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            rows.append({"processes": nproc, "tp": tp, "rollout_tp": tp_g, "skipped": f"failed: {tail}"})
            continue
        r = json.load(open(out))
        r["speedup"] = r["full_gather_s"] / r["hybrid_s"]
        rows.append(r)
    print(f"{'procs':>5} {'TP':>3} {'TP_g':>4} {'full gather s':>13} {'hybrid s':>9} {'speedup':>8} "
          f"{'comm MiB':>9} {'peak MiB':>9} {'same gen':>8}")
    for r in rows:
        head = f"{r['processes']:>5} {r['tp']:>3} {r['rollout_tp']:>4}"
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
            continue
        print(f"{head} {r['full_gather_s']:13.3f} {r['hybrid_s']:9.3f} {r['speedup']:7.2f}x "
              f"{r['hybrid_comm_bytes'] / 2**20:9.1f} {r['hybrid_peak_bytes'] / 2**20:9.1f} "
              f"{str(r['same_generation']):>8}")
    os.makedirs(args.out, exist_ok=True)
    res = {"benchmark": "transition", "size": size, "model": MODELS[size], "rows": rows, "repeats": args.repeats,
           "machine": f"{platform.machine()} {os.cpu_count()} cores; 1 thread per rank"}
    write_result(os.path.join(args.out, "bench_transition.json"), res, run_info)
    _plot(rows, os.path.join(args.out, "bench_transition.png"))
    return 0


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in rows if "skipped" not in r]
    labels = [f"{r['processes']} procs\nTP{r['tp']}→TP_g{r['rollout_tp']}" for r in ran]
    x = range(len(ran))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r["full_gather_s"] * 1e3 for r in ran], 0.4, label="full gather (before)")
    ax.bar([i + 0.2 for i in x], [r["hybrid_s"] * 1e3 for r in ran], 0.4, label="3D-HybridEngine")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("weights → generation per step (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
