"""Delta weight sync (rollout.sync=delta) vs the full sync, side by side in one run, per source engine.

The real model (SmolLM2-135M-Instruct, float32 training weights) syncs into a bfloat16 generation copy on the same
gloo ranks, from megatron TP=3 shards (3 ranks: its 9 attention heads and 3 KV heads do not split over TP=2),
FSDP2 dim-0 shards and torch replicas (2 ranks each; a replica holds the whole model). Between
syncs every training tensor moves by an Adam-sized step at the example's learning rate (examples/smollm2_gsm8k.yaml:
2e-6): lr · c · ξ, ξ a fixed N(0, 1) pool, c = ±1 drawn per 1M-element chunk and step (a random walk whose
per-element step is about lr, as Adam's normalised update is). Each sync is a delta sync (timed: the slowest
rank); every `--full-every` syncs the same weights also go the full way through the same plan into a second
bfloat16 copy (timed the same way), so both sides are measured under the same machine load. After the last sync
a full sync's result is compared with the delta-synced copy bit for bit; the periodic full check
(rollout.delta_verify_every) runs every `--verify-every` syncs inside the delta syncs themselves.

    python benchmarks/sync/bench_delta.py --syncs 1000                 # the issue's 1,000-sync equality
    python benchmarks/sync/bench_delta.py --syncs 20 --sources fsdp     # a quick look
Writes benchmarks/results/bench_delta_sync.json (per source: per-sync changed share, bytes, times; the table).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from verl.testing import run_distributed  # noqa: E402

POOL = 1 << 20


class _Copy:
    """A bfloat16 generation copy: the engine's tensors (what a delta writes into, what a full sync loads)."""

    def __init__(self, he, rank: int):
        self.sync_base = None
        self.tensors = {t.target.name: torch.zeros(t.target.shape, dtype=torch.bfloat16)
                        for t in he.plan.targets_of(rank)}

    def weight_tensors(self):
        return self.tensors

    def weight_names(self):
        return set(self.tensors)

    def update_weights(self, named):
        for name, t in named:
            self.tensors[name].copy_(t)


def _source(kind: str, path: str, world: int):
    """(local params, hybrid engine factory) of the actor over `world` ranks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.hybrid_engine import hybrid_engine_for_module, module_local_params
    if kind == "megatron":
        from verl.distributed import init_process_groups
        from verl.hybrid_engine.megatron import hybrid_engine_for, megatron_local_params
        from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
        pg = init_process_groups(tp=world, pp=1)
        model = build_gpt(AutoConfig.from_pretrained(path), pg, BuildOptions(vocab_multiple=32))
        load_hf_checkpoint(model, path)
        return lambda: megatron_local_params(model), lambda cfg: hybrid_engine_for(model, cfg)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return lambda: module_local_params(model), lambda cfg: hybrid_engine_for_module(model, cfg)


@torch.no_grad()
def _step(params: dict[str, torch.Tensor], step: int, lr: float, pool: torch.Tensor) -> None:
    for k, (name, t) in enumerate(sorted(params.items())):
        flat = t.view(-1)
        g = torch.Generator().manual_seed(step * 100003 + k)
        signs = (torch.randint(0, 2, (-(-flat.numel() // POOL),), generator=g) * 2 - 1).tolist()
        for c, start in zip(signs, range(0, flat.numel(), POOL)):
            part = flat[start:start + POOL]
            part.add_(pool[:part.numel()], alpha=lr * c)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _body(rank, world, kind, path, args):
    from verl.hybrid_engine import HybridEngineConfig
    torch.set_num_threads(1)
    local, make = _source(kind, path, world)
    cfg = dict(engine_dtype=torch.bfloat16, bucket_mb=args["bucket_mb"], generation_tp=1)
    delta = make(HybridEngineConfig(delta=True, verify_every=args["verify_every"], **cfg))
    full = make(HybridEngineConfig(**cfg))
    me = dist.get_rank()
    copy, other = _Copy(delta, me), _Copy(full, me)
    pool = torch.randn(POOL, generator=torch.Generator().manual_seed(7))
    rows = []
    for step in range(args["syncs"] + 1):
        if step:
            _step(local(), step, args["lr"], pool)
        t0 = time.perf_counter()
        d = delta.sync_delta(local(), copy)
        row = dict(step=step, sync_s=_slowest(time.perf_counter() - t0), full_sync=d.full,
                   changed_frac=d.changed / d.elements, bytes=d.engine_bytes, full_bytes=d.full_bytes,
                   comm_bytes=delta.last_stats.bytes_sent + delta.last_stats.bytes_received,
                   verified=d.verified, resyncs=d.bucket_resyncs + d.verify_failures, kinds=dict(d.kinds))
        if step and step % args["full_every"] == 0:
            t0 = time.perf_counter()
            full.sync(local(), other)
            row.update(full_s=_slowest(time.perf_counter() - t0),
                       full_comm_bytes=full.last_stats.bytes_sent + full.last_stats.bytes_received)
        rows.append(row)
    full.sync(local(), other)
    bad = [n for n, t in other.tensors.items()
           if not torch.equal(t.view(torch.int16), copy.tensors[n].view(torch.int16))]
    return dict(rows=rows, bit_exact=not bad, differing=bad[:5], tensors=len(other.tensors),
                elements=sum(t.numel() for t in other.tensors.values()))


def _summary(per_rank: list[dict]) -> dict:
    rows = [r for r in per_rank[0]["rows"] if r["step"] > 0]
    paired = [r for r in rows if "full_s" in r]
    comm = [sum(p["rows"][i]["comm_bytes"] for p in per_rank) for i in range(1, len(per_rank[0]["rows"]))]
    med = statistics.median
    out = dict(syncs=len(rows), bit_exact_after_all=all(p["bit_exact"] for p in per_rank),
               changed_frac_median=med(r["changed_frac"] for r in rows),
               changed_frac_min=min(r["changed_frac"] for r in rows),
               changed_frac_max=max(r["changed_frac"] for r in rows),
               bytes_median=med(r["bytes"] for r in rows), full_bytes=rows[0]["full_bytes"],
               comm_bytes_median=med(comm), resyncs=sum(r["resyncs"] for r in rows),
               verified_syncs=sum(r["verified"] for r in rows), forced_full=sum(r["full_sync"] for r in rows))
    out["bytes_ratio"] = out["bytes_median"] / out["full_bytes"]
    if paired:
        full_comm = [sum(p["rows"][r["step"]]["full_comm_bytes"] for p in per_rank) for r in paired]
        out.update(sync_s_median=med(r["sync_s"] for r in paired), full_s_median=med(r["full_s"] for r in paired),
                   full_comm_bytes=med(full_comm), paired_syncs=len(paired))
        out["time_ratio"] = statistics.median(r["sync_s"] / r["full_s"] for r in paired)
    return out


SCALED = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1376,
              max_position_embeddings=512, vocab_size=8192)
"""--model scaled: a Llama of SmolLM2's family, 8 heads / 4 KV heads (so megatron runs at TP=2), ~13M parameters:
the 1,000-sync equality run at a size this shared 2-core machine finishes."""


def _model_dir(name: str) -> str:
    if name != "scaled":
        from verl.models.pretrained import resolve_model_path
        return str(resolve_model_path(name))
    import tempfile

    from verl.config.ppo import TinyModelConfig
    from verl.models.tiny import save_tiny, tiny_model
    out = Path(tempfile.mkdtemp(prefix="verl-bench-delta-")) / "scaled"
    return str(save_tiny(tiny_model(TinyModelConfig(**SCALED), seed=3, initializer_range=0.02), None, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", nargs="+", default=["megatron", "fsdp", "torch"])
    ap.add_argument("--syncs", type=int, default=1000, help="delta syncs per source (after the first, full one)")
    ap.add_argument("--torch-syncs", type=int, default=0, help="syncs for the torch replicas (0: --syncs)")
    ap.add_argument("--full-every", type=int, default=20, help="time a full sync of the same weights every N syncs")
    ap.add_argument("--verify-every", type=int, default=100, help="rollout.delta_verify_every")
    ap.add_argument("--lr", type=float, default=2e-6, help="the example's learning rate")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="rollout.sync_bucket_mb")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a shipped model's name, a directory, or 'scaled'")
    ap.add_argument("--megatron-tp", type=int, default=3,
                    help="megatron's TP size (= its processes): SmolLM2-135M's 9 heads / 3 KV heads split over 3, not "
                         "2; the scaled model's over 2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_delta_sync.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    path = _model_dir(args.model)
    results = {}
    for kind in args.sources:
        syncs = args.torch_syncs if kind == "torch" and args.torch_syncs else args.syncs
        settings = dict(syncs=syncs, full_every=args.full_every, verify_every=args.verify_every, lr=args.lr,
                        bucket_mb=args.bucket_mb)
        t0 = time.time()
        world = args.megatron_tp if kind == "megatron" else 2
        per_rank = run_distributed(_body, world, args=(kind, path, settings), timeout=6 * 3600)
        results[kind] = dict(summary=_summary(per_rank), wall_s=time.time() - t0, processes=world,
                             differing=[p["differing"] for p in per_rank],
                             per_sync=[{k: v for k, v in r.items() if k != "kinds"} | {"kinds": r["kinds"]}
                                       for r in per_rank[0]["rows"]])
        s = results[kind]["summary"]
        print(f"{kind}: {s['syncs']} syncs, bit-exact {s['bit_exact_after_all']}, "
              f"changed {s['changed_frac_median']:.4f}, "
              f"bytes {s['bytes_ratio']:.4f} of full, time {s.get('time_ratio', float('nan')):.3f} of full", flush=True)
    meta = {"model": args.model, "threads_per_process": 1, "engine_dtype": "bfloat16",
            "training_dtype": "float32", "lr": args.lr, "host": platform.node(), "cpus": os.cpu_count(),
            "note": "times are the slowest rank's; bytes: what the engine of rank 0 is handed (payloads + headers; "
                    "full: its targets in bfloat16); comm: bytes over the wire, both ranks"}
    write_result(args.out, {"results": results}, run_info, **meta)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
