"""verl's CUDA kernels on one GPU: achieved HBM bandwidth as a share of the H200's 4.8 TB/s, and the fused RL loss
head (verl.ops.linear_rl_loss) against eager PyTorch and torch.compile at N=16384, V=151936 in bfloat16.

    python benchmarks/kernels/bench_gpu.py --out DIR            # on a GPU (scripts/gpu_check.sh runs it)
    python benchmarks/kernels/bench_gpu.py --dry-run --out DIR  # no GPU: every case at toy sizes on the CPU

Bandwidth: each kernel's compulsory traffic (every input read once, every output written once; the numbers in
BYTES below) over its median time of --iters CUDA-event-timed calls after warm-up. A kernel that makes extra
passes (the log-prob backward reads the logits twice, GAE walks each row backwards) shows a share below its real
traffic; that is the point of the figure. Loss head: median fwd+bwd time and peak allocated memory above the
inputs (torch.cuda.max_memory_allocated), the variants interleaved. Writes bench_gpu.json and bench_gpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
HBM_BYTES_PER_S = 4.8e12  # H200 SXM
GPU_SIZES = {"logits": (4096, 151936), "bt": (1024, 4096), "bucket_mib": 1024,
             "head": [(16384, 2048, 151936), (16384, 4096, 151936)]}
DRY_SIZES = {"logits": (8, 300), "bt": (4, 16), "bucket_mib": 1, "head": [(64, 16, 300)]}


def _timer(device):
    import torch
    if device.type == "cuda":
        def run(fn, iters):
            out = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            return out
        return run

    def run_cpu(fn, iters):
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out
    return run_cpu


def kernel_cases(device, sizes):
    """(name, fn, compulsory bytes) of each kernel family's hot op."""
    import torch

    import verl.ops as O
    g = torch.Generator(device="cpu").manual_seed(0)
    n, v = sizes["logits"]
    logits = torch.randn(n, v, generator=g).to(device, torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    lp, ent, lse = torch.ops.verl.logprob_entropy(logits, labels, 1.0, -100)
    ones = torch.ones(n, device=device)
    B, T = sizes["bt"]
    bt = lambda: torch.randn(B, T, generator=g).to(device)  # noqa: E731
    x, old, adv, ref = bt(), bt() - 1, bt(), bt() - 1
    mask = (torch.rand(B, T, generator=g) > 0.1).to(device)
    words = sizes["bucket_mib"] * 2**20 // 2 // 64
    bucket = [torch.randn(64, words // 64 + i, generator=g).to(device, torch.bfloat16) for i in range(64)]
    bucket_bytes = sum(t.numel() for t in bucket) * 2
    f32, b = 4, 1
    return [
        ("logprob_entropy bf16", lambda: torch.ops.verl.logprob_entropy(logits, labels, 1.0, -100), n * v * 2),
        ("logprob_entropy_backward bf16",
         lambda: torch.ops.verl.logprob_entropy_backward(ones, ones, None, logits, labels, lse, ent, 1.0, 0, -100),
         2 * n * v * 2),
        ("policy_loss fwd+grad f32", lambda: torch.ops.verl.policy_loss(x, old, adv, mask, "vanilla", 0.2, 0.28, 3.0,
                                                                         "token-mean", None, None, 1, None, True),
         B * T * (4 * f32 + b)),
        ("kl_loss fwd+grad f32", lambda: torch.ops.verl.kl_loss(x, ref, mask, "low_var_kl", "token-mean", None, None,
                                                                 1, None, True), B * T * (3 * f32 + b)),
        ("gae f32", lambda: O.compute_gae(x, adv, mask, 1.0, 0.95), B * T * (4 * f32 + b)),
        ("masked_whiten f32", lambda: O.masked_whiten(x, mask), B * T * (2 * f32 + b)),
        ("reshard_pack bf16", lambda: O.reshard_pack(bucket), 2 * bucket_bytes),
    ]


def bench_kernels(device, sizes, iters) -> list[dict]:
    import torch
    run = _timer(device)
    rows = []
    for name, fn, nbytes in kernel_cases(device, sizes):
        run(fn, 3)
        t = statistics.median(run(fn, iters))
        bw = nbytes / t
        rows.append({"kernel": name, "bytes": nbytes, "median_s": t, "GBps": bw / 1e9,
                     "hbm_share": bw / HBM_BYTES_PER_S if device.type == "cuda" else None})
        print(f"  {name:32s} {t * 1e3:9.3f} ms  {bw / 1e9:8.1f} GB/s"
              + (f"  {bw / HBM_BYTES_PER_S:6.1%} of 4.8 TB/s" if device.type == "cuda" else ""), flush=True)
    del torch
    return rows


def _head_variants(h, w, y, mask, adv, old, ref, compile_: bool):
    import torch

    import verl.ops as O
    from bench_logprob import LOSS_KW as kw, eager_rl_loss  # the same eager baseline as the CPU bench

    def eager(hd, wt):
        return eager_rl_loss(hd, wt, y, mask, adv, old, ref, 0.9)[0]

    def fused(hd, wt):
        return O.linear_rl_loss(hd, wt, y, mask, adv, old_logprob=old, ref_logprob=ref, temperature=0.9, **kw).loss

    out = {"eager": eager, "fused": fused}
    if compile_:
        out["compiled"] = torch.compile(eager)
    return out


def bench_head(device, sizes, iters, compile_: bool) -> list[dict]:
    import torch
    rows = []
    for n, hdim, v in sizes["head"]:
        g = torch.Generator(device="cpu").manual_seed(1)
        T = min(1024, n)
        B = n // T
        dt = torch.bfloat16
        h = (torch.randn(n, hdim, generator=g) * 0.5).to(device, dt).requires_grad_()
        w = (torch.randn(v, hdim, generator=g) / hdim**0.5).to(device, dt).requires_grad_()
        y = torch.randint(0, v, (B, T), generator=g).to(device)
        mask = (torch.rand(B, T, generator=g) > 0.05).float().to(device)
        adv, old, ref = (torch.randn(B, T, generator=g).to(device) * s - o for s, o in ((1, 0), (0.1, 11), (0.1, 11)))
        variants = _head_variants(h, w, y, mask, adv, old, ref, compile_)
        run = _timer(device)
        samples = {k: [] for k in variants}
        peaks, losses = {}, {}
        for k, f in variants.items():  # warm-up (and compile), then the peak of one clean step
            step = lambda f=f: f(h, w).backward()  # noqa: E731
            h.grad = w.grad = None
            step()
            h.grad = w.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = f(h, w)
            loss.backward()
            losses[k] = float(loss.detach())
            peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
        for _ in range(iters):
            for k, f in variants.items():
                h.grad = w.grad = None
                samples[k] += run(lambda f=f: f(h, w).backward(), 1)
        med = {k: statistics.median(s) for k, s in samples.items()}
        row = {"N": n, "H": hdim, "V": v, "dtype": "bfloat16", "median_s": med, "peak_mib": peaks, "loss": losses,
               "time_fused_vs_eager": med["fused"] / med["eager"]}
        if "compiled" in med:
            row["time_fused_vs_compiled"] = med["fused"] / med["compiled"]
        if peaks["fused"] is not None:
            row["peak_fused_vs_eager"] = peaks["fused"] / peaks["eager"]
        print(f"  head N={n} H={hdim} V={v}: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in med.items())
              + f" | fused/eager {row['time_fused_vs_eager']:.3f}" + (f" peak MiB {peaks}" if peaks["fused"] else ""),
              flush=True)
        rows.append(row)
        del h, w, variants
    return rows


def _plot(kernels, heads, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    shares = [r["hbm_share"] or 0.0 for r in kernels]
    axes[0].barh([r["kernel"] for r in kernels], shares)
    axes[0].set_xlim(0, 1)
    axes[0].set_title("achieved HBM bandwidth / 4.8 TB/s")
    for i, r in enumerate(heads):
        for j, (k, t) in enumerate(r["median_s"].items()):
            axes[1].bar(i + (j - 1) * 0.27, t * 1e3, 0.27, label=k if i == 0 else None)
    axes[1].set_xticks(range(len(heads)))
    axes[1].set_xticklabels([f"N={r['N']} H={r['H']}\nV={r['V']}" for r in heads], fontsize=8)
    axes[1].set_title("RL loss head fwd+bwd, bf16 (ms)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"))
    ap.add_argument("--dry-run", action="store_true", help="no GPU: run every case at toy sizes on the CPU")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant of the loss head")
    args = ap.parse_args()
    import torch

    from verl import _extension
    if not _extension.available():
        sys.exit(f"bench_gpu: verl._C does not import: {_extension.load_error()}")
    if args.dry_run:
        device, sizes, iters = torch.device("cpu"), DRY_SIZES, 2
    else:
        if not (torch.cuda.is_available() and _extension.built_with_cuda()):
            sys.exit("bench_gpu: needs a CUDA GPU and verl._C built with CUDA (or pass --dry-run)")
        device, sizes, iters = torch.device("cuda"), GPU_SIZES, args.iters
    t0 = time.time()
    print(f"[bench_gpu] {'dry run on CPU' if args.dry_run else torch.cuda.get_device_name()}", flush=True)
    kernels = bench_kernels(device, sizes, iters)
    heads = bench_head(device, sizes, max(3, iters // 4), compile_=not args.no_compile and not args.dry_run)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "iters": iters, "wall_s": time.time() - t0, "dry_run": args.dry_run,
            "command": " ".join(["python", "benchmarks/kernels/bench_gpu.py", *sys.argv[1:]])}
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as fh:
        json.dump({"meta": meta, "kernels": kernels, "loss_head": heads}, fh, indent=2)
    _plot(kernels, heads, os.path.join(args.out, "bench_gpu.png"))
    print(f"[bench_gpu] wrote {args.out}/bench_gpu.json and .png ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
