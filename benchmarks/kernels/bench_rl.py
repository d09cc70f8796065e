"""Benchmark of verl's fused RL kernels against the pure-PyTorch references, side by side in one run.

For each op and shape: the fused kernel (torch.ops.verl.*), the eager reference (op by op, the way RL frameworks
write it) and torch.compile of that reference (inductor); GAE is also timed against a per-timestep Python loop
(its reference is that loop; compiling a T-step unrolled loop takes minutes, so GAE has no compiled column).
Losses are timed forward + backward (what a training step pays); advantages forward only. Each figure is the
minimum over interleaved rounds (the machine may be shared; see timeit_interleaved).

    python benchmarks/kernels/bench_rl.py              # --quick (default): B=256, T=512, float32 + bfloat16
    python benchmarks/kernels/bench_rl.py --full       # B in {256, 1024} x T in {512, 4096}
    python benchmarks/kernels/bench_rl.py --no-compile # skip the torch.compile column

Writes benchmarks/results/bench_rl.json and bench_rl.png (speed-up ratios, higher is better for fused).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import verl.ops as O  # noqa: E402
from verl import _extension  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")


def timeit_interleaved(fns: dict, rounds: int = 15, budget_s: float = 4.0) -> dict:
    """Best (minimum) seconds per call of each callable, timed in interleaved rounds.

    On a shared machine a preempted run is slower, never faster, so the minimum is the estimate least polluted
    by other processes, and interleaving exposes every variant to the same load.
    """
    for fn in fns.values():
        fn()  # warm-up (and compilation)
    best = {k: float("inf") for k in fns}
    start = time.perf_counter()
    for r in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return best


def make_inputs(B: int, T: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    r = lambda s=1.0: (torch.randn(B, T, generator=g) * s).to(dtype)  # noqa: E731
    logprob = r(0.5) - 1.0
    return dict(mask=mask, rewards=r(), values=r(), logprob=logprob, old=(logprob.float() + r(0.2).float()).to(dtype),
                ref=(logprob.float() + r(0.2).float()).to(dtype), adv=r(), returns=r(),
                index=torch.arange(B) // 8, entropy=r().abs())


def fwd_bwd(fn, x):
    def run():
        x.grad = None
        fn(x).backward()
    return run


def cases(inp: dict):
    """(name, fused callable, reference fn taking the differentiable input or None, differentiable input)."""
    m = inp["mask"]
    agg = O.Aggregation(mode="token-mean")
    lp = inp["logprob"].clone().requires_grad_()
    v = inp["values"].clone().requires_grad_()
    ent = inp["entropy"].clone().requires_grad_()
    yield ("policy_loss", fwd_bwd(lambda x: O.policy_loss(x, inp["old"], inp["adv"], m, agg=agg).loss, lp),
           lambda x: O.policy_loss_ref(x, inp["old"], inp["adv"], m, "vanilla", 0.2, 0.2, 3.0, agg).loss, lp)
    yield ("value_loss", fwd_bwd(lambda x: O.value_loss(x, inp["old"], inp["returns"], m, 0.5, agg=agg).loss, v),
           lambda x: O.value_loss_ref(x, inp["old"], inp["returns"], m, 0.5, agg).loss, v)
    yield ("kl_loss_k3", fwd_bwd(lambda x: O.kl_loss(x, inp["ref"], m, "low_var_kl", agg), lp),
           lambda x: O.kl_loss_ref(x, inp["ref"], m, "low_var_kl", agg), lp)
    yield ("entropy_agg", fwd_bwd(lambda x: O.agg_loss(x, m, "seq-mean-token-mean"), ent),
           lambda x: O.agg_loss_ref(x, m, "seq-mean-token-mean"), ent)
    yield ("grpo_advantage",
           lambda: O.outcome_advantage(inp["rewards"], m, inp["index"], "grpo", check_finite=False),
           lambda x: O.outcome_advantage_ref(x, m, inp["index"], "grpo")[0], None)
    yield ("gae", lambda: O.compute_gae(inp["rewards"], inp["values"], m, 0.99, 0.95, whiten=True,
                                        check_finite=False),
           None, None)


def bench_shape(B: int, T: int, dtype: torch.dtype, compile_ref: bool) -> list[dict]:
    inp = make_inputs(B, T, dtype)
    rows = []
    for name, fused, ref_fn, x in cases(inp):
        row = dict(op=name, B=B, T=T, dtype=str(dtype).replace("torch.", ""))
        fns = {"fused": fused}
        if name == "gae":
            def loop():
                with O.backend("reference"):
                    O.compute_gae(inp["rewards"], inp["values"], inp["mask"], 0.99, 0.95, whiten=True,
                                  check_finite=False)
            fns["eager"] = loop
        elif x is None:
            fns["eager"] = lambda f=ref_fn: f(inp["rewards"])
            if compile_ref:
                c = torch.compile(ref_fn)
                fns["compiled"] = lambda c=c: c(inp["rewards"])
        else:
            fns["eager"] = fwd_bwd(ref_fn, x)
            if compile_ref:
                fns["compiled"] = fwd_bwd(torch.compile(ref_fn), x)
        best = timeit_interleaved(fns, rounds=5 if name == "gae" else 15)
        row["fused_ms"] = best["fused"] * 1e3
        row["eager_ms"] = best["eager"] * 1e3
        if name == "gae":
            row["python_loop_ms"] = row["eager_ms"]
        if "compiled" in best:
            row["compiled_ms"] = best["compiled"] * 1e3
        row["speedup_vs_eager"] = row["eager_ms"] / row["fused_ms"]
        if "compiled_ms" in row:
            row["speedup_vs_compiled"] = row["compiled_ms"] / row["fused_ms"]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    comp = f"{r['compiled_ms']:9.3f}" if "compiled_ms" in r else "      n/a"
    sc = f"{r['speedup_vs_compiled']:6.2f}x" if "speedup_vs_compiled" in r else "    n/a"
    base = "loop" if r["op"] == "gae" else "eager"
    return (f"{r['op']:15s} B={r['B']:5d} T={r['T']:5d} {r['dtype']:8s} fused {r['fused_ms']:9.3f} ms | "
            f"{base} {r['eager_ms']:9.3f} ms ({r['speedup_vs_eager']:6.2f}x) | compiled {comp} ms ({sc})")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['op']}\n{r['B']}x{r['T']} {r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["speedup_vs_eager"] for r in rows], width=0.4,
           label="fused vs eager reference (GAE: vs per-timestep loop)")
    ax.bar([x + 0.2 for x in xs], [r.get("speedup_vs_compiled", 0.0) for r in rows], width=0.4,
           label="fused vs torch.compile(reference)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up (x, log scale)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_title(f"verl RL kernels on CPU ({torch.get_num_threads()} threads), higher is better")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small default matrix (B=256, T=512)")
    ap.add_argument("--full", action="store_true", help="B in {256, 1024} x T in {512, 4096}, float32 and bfloat16")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--out", default=RESULTS, help="folder for bench_rl.json / bench_rl.png")
    args = ap.parse_args(argv)
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    if not _extension.available():
        print(f"verl._C is not built: {_extension.load_error()}; {_extension.BUILD_HINT}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(B, T) for B in (256, 1024) for T in (512, 4096)] if args.full else [(256, 512)]
    rows = []
    for B, T in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            rows += bench_shape(B, T, dtype, compile_ref=not args.no_compile)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
                processor=platform.processor(), matrix="full" if args.full else "quick",
                compile_backend=None if args.no_compile else "inductor")
    write_result(os.path.join(args.out, "bench_rl.json"), dict(meta=meta, results=rows), run_info)
    plot(rows, os.path.join(args.out, "bench_rl.png"))
    print(f"wrote {os.path.join(args.out, 'bench_rl.json')} and bench_rl.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
