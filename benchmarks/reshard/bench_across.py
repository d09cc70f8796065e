"""The weight sync to a rollout on its own ranks, against the sync to a rollout on the actor's ranks, in one run.

Four gloo processes. A Llama-architecture actor trained data-parallel on ranks 0-1, as whole copies (torch engine)
or FSDP2 dim-0 shards; each repeat times, interleaved:
  own ranks     the 3D-HybridEngine across rank sets (`hybrid_engine_across`): ranks 0-1 send, the rollout
                engines on ranks 2-3 receive their generation weights (rollout.tp = 1)
  actor's ranks the same-ranks plan (`hybrid_engine_for_module`) into rollout engines on ranks 0-1 (whole copies
                move nothing; FSDP2 ranks gather the rows they lack), ranks 2-3 waiting
Both push into an engine that copies every tensor into its own model (what the torch engine does). Reported per
case and actor layout: median seconds, bytes sent and received per rank, peak extra memory, and a bitwise check
that the rollout's model equals the actor's after each sync.

    python benchmarks/reshard/bench_across.py            # hidden 256 x 4 layers, vocab 32000 (~20M parameters)
    python benchmarks/reshard/bench_across.py --full     # hidden 768 x 12 layers (~134M parameters)
Writes benchmarks/results/bench_across.json.
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

MODELS = {"full": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                       intermediate_size=2048, vocab_size=32000),
          "quick": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        intermediate_size=688, vocab_size=32000)}
ACTOR, ROLLOUT = (0, 1), (2, 3)


class _Engine:
    """A rollout engine's weight loading: every received tensor copied into its own model's parameter."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())

    def update_weights(self, named):
        for name, t in named:
            self.params[name].data.copy_(t)


def _model(size: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODELS[size], max_position_embeddings=256, tie_word_embeddings=False))


def _actor(size: str, layout: str, group):
    """This actor rank's module: a whole copy, or FSDP2-sharded over the actor's ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    model = _model(size)
    if layout == "fsdp":
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full(module) -> dict:
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}


def _timed(fn) -> float:
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _case(rank, size, layout, repeats, actor_group):
    """Times both syncs for one actor layout; returns this rank's figures."""
    import torch
    import torch.distributed as dist

    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_across, hybrid_engine_for_module
    from verl.hybrid_engine.module import module_local_params
    config = HybridEngineConfig(bucket_mb=64)
    actor = _actor(size, layout, actor_group) if rank in ACTOR else None
    engine = _Engine(_model(size))  # every rank: the rollout's own model (rank 0-1's for "actor's ranks")
    across = hybrid_engine_across(actor, None if actor is not None else config, group=dist.group.WORLD,
                                  actor_ranks=ACTOR, rollout_ranks=ROLLOUT, shard_group=actor_group)
    same = hybrid_engine_for_module(actor, config, group=actor_group) if actor is not None else None
    local = module_local_params(actor) if actor is not None else {}
    times, stats = {"own": [], "shared": []}, {}
    for _ in range(repeats):
        times["own"].append(_timed(lambda: across.sync(local, None if actor is not None else engine)))
        stats["own"] = across.last_stats
        times["shared"].append(_timed(lambda: same.sync(local, engine) if same is not None else None))
        stats["shared"] = same.last_stats if same is not None else None
    want = _full(actor) if actor is not None else None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, want if rank == 0 else None)
    exact = all(torch.equal(engine.params[n], w) for n, w in everyone[0].items())
    out = {"layout": layout, "exact": exact}
    for case, st in stats.items():
        out[case] = None if st is None else {"s": statistics.median(times[case]), "sent": st.bytes_sent,
                                             "received": st.bytes_received, "peak": st.peak_bytes}
    return out


def worker(rank: int, world: int, size: str, repeats: int) -> list[dict]:
    import torch

    from verl.distributed import new_group
    torch.set_num_threads(1)
    actor_group = new_group(list(ACTOR))
    return [_case(rank, size, layout, repeats, actor_group) for layout in ("whole", "fsdp")]


def main() -> None:
    from verl.testing import run_distributed
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~20M-parameter model (default)")
    parser.add_argument("--full", action="store_true", help="a ~134M-parameter model")
    parser.add_argument("--repeats", type=int, default=5)
    args, _ = parser.parse_known_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    size = "full" if args.full else "quick"
    per_rank = run_distributed(worker, 4, args=(size, args.repeats), timeout=1800)
    rows = []
    for i, layout in enumerate(("whole", "fsdp")):
        for case in ("own", "shared"):
            ranks = ROLLOUT + ACTOR if case == "own" else ACTOR
            figs = {r: per_rank[r][i][case] for r in ranks}
            rows.append({"actor": layout, "rollout_on": "own ranks 2-3" if case == "own" else "actor's ranks 0-1",
                         "seconds": max(f["s"] for f in figs.values()),
                         "sent_per_rank": {r: f["sent"] for r, f in figs.items()},
                         "received_per_rank": {r: f["received"] for r, f in figs.items()},
                         "peak_per_rank": {r: f["peak"] for r, f in figs.items()},
                         "bit_exact": all(per_rank[r][i]["exact"] for r in ranks)})
    for r in rows:
        print(f"{r['actor']:5s} actor -> rollout on {r['rollout_on']:17s} {r['seconds']:.3f} s  sent "
              f"{r['sent_per_rank']}  received {r['received_per_rank']}  peak {r['peak_per_rank']}  "
              f"bit-exact {r['bit_exact']}")
    out = os.path.join(ROOT, "benchmarks", "results", "bench_across.json")
    # meta carries the machine's load: on a shared CPU the seconds are only comparable within one run
    write_result(out, {"model": MODELS[size], "repeats": args.repeats, "rows": rows}, run_info)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
