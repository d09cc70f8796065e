"""Reshard (3D-HybridEngine, lazy bucketed gather) vs a naive full all-gather of every parameter on every
rank: wall time and peak extra memory, same model, same world, same run.

  lazy    HybridEngine.stream(): only the slices a generation rank needs, bucket by bucket; each yielded
          tensor is consumed (as an engine would copy it) and dropped.
  naive   every parameter's local shard all-gathered over the whole world (what an FSDP-style gather does),
          full Megatron tensors rebuilt and split into HF q/k/v and gate/up: every rank holds the full model.

Layouts (PP = 1): 2 processes TP2→TP_g 2 and TP2→TP_g 1; 4 processes TP4→TP_g 2, TP2·DP2→TP_g 2 and
TP2·DP2→TP_g 1. Peak extra memory is measured twice: the bytes of reshard buffers/targets alive at once
(accounted by the executor; for naive the gathered list plus the full tensors) and the peak resident set
(VmHWM reset through /proc/self/clear_refs, minus the resident set before; MALLOC_MMAP_THRESHOLD_ makes
freed tensors go back to the OS). Times are the slowest rank, best of `--repeats`.

    python benchmarks/reshard/bench_reshard.py            # --quick: ~42M params (default)
    python benchmarks/reshard/bench_reshard.py --full     # ~100M params (the issue's size)
Writes benchmarks/results/bench_reshard.json and .png.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from verl.testing import run_distributed  # noqa: E402

MODELS = {
    "quick": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=16000),
    "full": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=16000),
}
CASES = {2: [(2, 1, 1, 2), (2, 1, 1, 1)], 4: [(4, 1, 1, 2), (2, 1, 2, 2), (2, 1, 2, 1)]}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(name: str) -> SimpleNamespace:
    c = MODELS[name]
    return SimpleNamespace(**c, model_type="llama", tie_word_embeddings=False, max_position_embeddings=2048,
                           rms_norm_eps=1e-6, head_dim=c["hidden_size"] // c["num_attention_heads"])


def _model_layout(cfg, tp: int, pp: int):
    """The megatron GPT's ModelLayout (vocabulary padded to a multiple of 128·TP), from metadata alone."""
    from verl.models import arch_from_hf, parallel_layout
    from verl.models.layout import megatron_model_layout
    arch = arch_from_hf(cfg)
    return megatron_model_layout(arch, parallel_layout(arch, tp, 128), pp=pp, dtype=torch.float32)


def _naive(local, meta, layout, rank):
    """Full all-gather of every parameter over the world, then Megatron → HF layout on every rank."""
    shapes = {n: s for g in meta.groups for n, s in zip(g.names, g.shapes)}
    world = layout.world_size
    out, held = {}, 0
    for spec in meta.params:
        t = local[spec.name]
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        held = max(held, sum(p.nbytes for p in parts) + sum(v.nbytes for v in out.values()))
        tp_parts = [parts[layout.rank_of(r, 0, 0)] for r in range(layout.tp_size)]
        for r, piece in enumerate(tp_parts if spec.dim is not None else tp_parts[:1]):
            for seg, off in spec.local_segments(r):
                if seg.hf_name is not None:
                    if seg.hf_name not in out:
                        out[seg.hf_name] = torch.empty(shapes[seg.hf_name], dtype=t.dtype)
                    out[seg.hf_name].narrow(spec.cut_dim, seg.start, seg.length).copy_(
                        piece.narrow(spec.cut_dim, off, seg.length))
        del parts, tp_parts
    return out, max(held, sum(v.nbytes for v in out.values()))


def body(rank, world, case, model, bucket_mb, repeats):
    from verl.distributed import Placement
    from verl.hybrid_engine import HybridEngine, HybridEngineConfig
    torch.set_num_threads(1)
    tp, pp, dp, tp_g = case
    layout = Placement.layout(tp=tp, pp=pp, dp=dp)
    meta = _model_layout(_config(model), tp, pp)
    he = HybridEngine(meta, layout, HybridEngineConfig(generation_tp=tp_g, bucket_mb=bucket_mb))
    g = torch.Generator().manual_seed(rank)
    local = {n: torch.randn(s, generator=g) for n, s in he.plan.local_params(rank).items()}
    res = {"lazy_s": [], "naive_s": []}
    for _ in range(repeats):
        dist.barrier()
        base = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        n = 0
        for _name, tensor in he.stream(local):
            n += tensor.numel()  # consumed, then dropped, as an engine copying it in would
            del tensor
        dist.barrier()
        res["lazy_s"].append(time.perf_counter() - t0)
        res["lazy_rss"] = _hwm() - base
        res["lazy_accounted"] = he.last_stats.peak_bytes
        res["lazy_sent"] = he.last_stats.bytes_sent
        res["lazy_numel"] = n
        dist.barrier()
        base = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        full, held = _naive(local, meta, layout, rank)
        dist.barrier()
        res["naive_s"].append(time.perf_counter() - t0)
        res["naive_rss"] = _hwm() - base
        res["naive_accounted"] = held
        res["naive_numel"] = sum(v.numel() for v in full.values())
        del full
    res["params"] = sum(math.prod(s) for g in meta.groups for s in g.shapes)
    return res


def run(model: str, bucket_mb: float, repeats: int) -> list[dict]:
    rows = []
    for world, cases in CASES.items():
        for case in cases:
            per_rank = run_distributed(body, world, args=(case, model, bucket_mb, repeats), timeout=1800)
            lazy = min(max(r["lazy_s"][i] for r in per_rank) for i in range(repeats))
            naive = min(max(r["naive_s"][i] for r in per_rank) for i in range(repeats))
            row = dict(world=world, tp=case[0], pp=case[1], dp=case[2], tp_g=case[3], params=per_rank[0]["params"],
                       lazy_ms=lazy * 1e3, naive_ms=naive * 1e3, time_ratio=lazy / naive,
                       lazy_peak_mb=max(r["lazy_rss"] for r in per_rank) / 2**20,
                       naive_peak_mb=max(r["naive_rss"] for r in per_rank) / 2**20,
                       lazy_accounted_mb=max(r["lazy_accounted"] for r in per_rank) / 2**20,
                       naive_accounted_mb=max(r["naive_accounted"] for r in per_rank) / 2**20,
                       lazy_sent_mb=sum(r["lazy_sent"] for r in per_rank) / 2**20, bucket_mb=bucket_mb)
            row["memory_ratio"] = row["lazy_accounted_mb"] / row["naive_accounted_mb"]
            rows.append(row)
            print(f"world={world} TP{case[0]}·DP{case[2]}→TP_g{case[3]}: lazy {row['lazy_ms']:.0f} ms vs naive "
                  f"{row['naive_ms']:.0f} ms ({row['time_ratio']:.2f}x); peak extra lazy "
                  f"{row['lazy_accounted_mb']:.0f} MB (RSS {row['lazy_peak_mb']:.0f}) vs naive "
                  f"{row['naive_accounted_mb']:.0f} MB (RSS {row['naive_peak_mb']:.0f})", flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['world']}p TP{r['tp']}·DP{r['dp']}→{r['tp_g']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = range(len(rows))
    for ax, key, unit in ((axes[0], "ms", "time (ms)"), (axes[1], "accounted_mb", "peak extra memory (MB)")):
        ax.bar([i - 0.2 for i in x], [r[f"naive_{key}"] for r in rows], 0.4, label="naive all-gather")
        ax.bar([i + 0.2 for i in x], [r[f"lazy_{key}"] for r in rows], 0.4, label="verl lazy reshard")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_ylabel(unit)
        ax.legend()
    fig.suptitle(f"Reshard vs naive all-gather, {rows[0]['params'] / 1e6:.0f}M params fp32, "
                 f"bucket {rows[0]['bucket_mb']} MB (CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~42M-parameter model (default)")
    ap.add_argument("--full", action="store_true", help="~100M-parameter model")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    model = "full" if args.full else "quick"
    rows = run(model, args.bucket_mb, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(benchmark="reshard", model=model, model_config=MODELS[model], dtype="float32",
                machine=f"{platform.machine()} {os.cpu_count()} cores, shared; gloo over loopback",
                torch=torch.__version__)
    write_result(os.path.join(args.out, "bench_reshard.json"), dict(meta=meta, rows=rows), run_info)
    plot(rows, os.path.join(args.out, "bench_reshard.png"))


if __name__ == "__main__":
    main()
