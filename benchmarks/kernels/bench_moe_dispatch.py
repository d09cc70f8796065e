"""Mixture-of-experts token dispatch on the CPU: verl's fused kernel pair against megatron-core's permutation and
an eager PyTorch reference, side by side in one run.

The work of one MoE layer's dispatch as megatron-core's all-to-all dispatcher does it (top-k routing already
done): permute the tokens to expert-contiguous rows with their routing weights, then (after the experts, here
the identity) unpermute them and combine each token's K rows; forward and backward. The backward starts from
the gradients a next layer hands back: g, a fixed random [T, H] tensor, for the combined rows (a dense gradient;
a plain sum's would be a stride-0 tensor no model produces) and ones for the permuted weights, so every gradient
path runs and nothing but the dispatch is timed (a loss <combined, g> would add two [T, H] products, the same
for every variant, to each step). The check value, <combined, g> + sum of the permuted weights, is computed
outside the timed step.

    verl       verl.ops.moe_permute / moe_unpermute (verl._C: a stable counting sort, row gathers, a per-token
               combine; the backward is gathers too)
    megatron   megatron.core.transformer.moe.moe_utils.permute / unpermute (fused=False: its CPU path), fed the
               dense [T, E] routing map and probs its router produces
    eager      verl.ops.moe_permute_ref / moe_unpermute_ref (argsort, index, gather-and-sum in PyTorch)

Time: thread CPU time of one thread (OMP_NUM_THREADS=1, immune to the other jobs on a shared machine), min over
`--reps` rounds that interleave the variants. Memory: peak extra resident memory of one fwd+bwd, each variant in
its own process (VmHWM reset just before, freed tensors returned to the OS), inputs excluded.

Every size runs twice: with PyTorch's default allocator, and with THP_MEM_ALLOC_ENABLE=1 (PyTorch then asks for
transparent huge pages for every tensor, as verl's CPU kernels do for their own large outputs). The dispatch is
memory-bound; on a CPU much of its time is the first touch of freshly allocated output pages, so the second
setting shows what is left when every variant gets huge pages: the kernels' own difference.

    python benchmarks/kernels/bench_moe_dispatch.py             # 4096x1024x8 and 16384x2048x64, top-2
Writes benchmarks/results/bench_moe_dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [(4096, 1024, 8), (16384, 2048, 64)]
TOP_K = 2
VARIANTS = ("verl", "megatron", "eager")


def _inputs(T: int, H: int, E: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    probs, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    routing = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
    dense = torch.zeros(T, E).scatter(1, ids, probs)
    return {"hidden": torch.randn(T, H, generator=g), "ids": ids, "probs": probs, "routing": routing,
            "dense_probs": dense, "E": E, "upstream": torch.randn(T, H, generator=g)}


def _step(variant: str, x: dict):
    """One fwd+bwd of the dispatch pair: returns a callable giving the loss (after backward)."""
    import torch
    T, H = x["hidden"].shape

    if variant == "megatron":
        from megatron.core.transformer.moe.moe_utils import permute, unpermute

        def run(h, p):
            permuted, pp, order = permute(h, x["routing"], probs=p, num_out_tokens=T * TOP_K)
            return unpermute(permuted, order, restore_shape=h.shape), pp
        probs_of = "dense_probs"
    else:
        from verl.ops import moe as M
        permute, unpermute = ((M.moe_permute, M.moe_unpermute) if variant == "verl"
                              else (M.moe_permute_ref, M.moe_unpermute_ref))

        def run(h, p):
            out = permute(h, x["ids"], p, x["E"])
            return unpermute(out.permuted, out.dst_of), out.permuted_probs
        probs_of = "probs"

    def step(check: bool = False):
        h = x["hidden"].detach().requires_grad_()
        p = x[probs_of].detach().requires_grad_()
        out, pp = run(h, p)
        torch.autograd.backward((out, pp), (x["upstream"], torch.ones_like(pp)))
        return float((out.detach() * x["upstream"]).sum() + pp.detach().sum()) if check else None
    return step


# ----------------------------------------------------------------------------------------- child process

def _rss_mib() -> tuple[float, float]:
    with open("/proc/self/status") as f:
        s = f.read()
    return (int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) / 1024, int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024)


def _child_mem(variant: str, T: int, H: int, E: int) -> dict:
    x = _inputs(T, H, E)
    step = _step(variant, x)
    # warm-up: first-call allocations (thread pools, dispatcher caches) are not the op's memory
    loss = step(check=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_mib()[1]
    step()
    return {"peak_mib": _rss_mib()[0] - base, "loss": loss}


def _child_time(T: int, H: int, E: int, reps: int) -> dict:
    x = _inputs(T, H, E)
    steps = {v: _step(v, x) for v in VARIANTS}
    best = {v: float("inf") for v in VARIANTS}
    losses = {}
    for v, s in steps.items():
        losses[v] = s(check=True)  # warm-up
    for _ in range(reps):
        for v, s in steps.items():
            c0 = time.thread_time()
            s()
            best[v] = min(best[v], time.thread_time() - c0)
    return {"seconds": best, "losses": losses}


# ----------------------------------------------------------------------------------------------- parent

ALLOCATORS = {"default": {}, "thp_all": {"THP_MEM_ALLOC_ENABLE": "1"}}


def _run_child(argv: list, timeout: float, allocator: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **ALLOCATORS[allocator])
    p = subprocess.run([sys.executable, __file__, "--child", *map(str, argv)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{(p.stderr or p.stdout)[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _measure(T: int, H: int, E: int, reps: int, allocator: str) -> dict:
    timing = _run_child(["time", T, H, E, reps], timeout=3600, allocator=allocator)
    mem = {v: _run_child(["mem", v, T, H, E], timeout=3600, allocator=allocator) for v in VARIANTS}
    sec = timing["seconds"]
    row = {"allocator": allocator, "tokens": T, "hidden": H, "experts": E, "top_k": TOP_K,
           "seconds": sec, "peak_extra_mib": {v: mem[v]["peak_mib"] for v in VARIANTS},
           "speedup_vs_eager": sec["eager"] / sec["verl"], "speedup_vs_megatron": sec["megatron"] / sec["verl"],
           "memory_vs_eager": mem["verl"]["peak_mib"] / mem["eager"]["peak_mib"],
           "memory_vs_megatron": mem["verl"]["peak_mib"] / mem["megatron"]["peak_mib"],
           "losses": timing["losses"]}
    print(f"[{allocator}] T={T} H={H} E={E}: verl {sec['verl'] * 1e3:.0f} ms, "
          f"megatron {sec['megatron'] * 1e3:.0f} ms, eager "
          f"{sec['eager'] * 1e3:.0f} ms -> {row['speedup_vs_megatron']:.2f}x megatron, {row['speedup_vs_eager']:.2f}x "
          f"eager; peak MiB verl {mem['verl']['peak_mib']:.0f}, megatron {mem['megatron']['peak_mib']:.0f}, eager "
          f"{mem['eager']['peak_mib']:.0f}", flush=True)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "time":
            out = _child_time(*map(int, rest))
        else:
            out = _child_mem(rest[0], *map(int, rest[1:]))
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per variant (min is kept)")
    ap.add_argument("--sizes", default=",".join(f"{t}x{h}x{e}" for t, h, e in SIZES),
                    help="tokens x hidden x experts, comma-separated")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_moe_dispatch.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    rows = [_measure(T, H, E, args.reps, a) for a in ALLOCATORS for T, H, E in sizes]
    meta = {"threads": 1, "timing": "thread CPU time, min over reps, variants interleaved",
            "memory": "peak extra resident memory of one fwd+bwd (VmHWM), a process per variant",
            "work": f"permute with weights + unpermute-and-combine, forward and backward from a given upstream "
                    f"gradient (no loss op timed), top-{TOP_K}"}
    write_result(args.out, {"meta": meta, "rows": rows}, run)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
