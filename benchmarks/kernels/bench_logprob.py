"""Peak memory and time of per-token log-prob + entropy from the LM head: fused vs eager vs torch.compile.

Variants, all computing (logprob, entropy) of labels under softmax(hidden @ W.T / T), forward + backward
of loss = sum(logprob * a + entropy * b) w.r.t. hidden and W:
  eager          h @ W.T, div_ by T, log_softmax, gather, entropy = -(exp(logp) * logp).sum (what verl did)
  compiled       torch.compile (inductor) of `eager`; its compile run is excluded from the figures
  fused_logits   h @ W.T, then verl.ops.logprob_entropy (the streaming kernel on materialised logits)
  fused_linear   verl.ops.linear_logprob_entropy (chunked GEMMs; logits never whole)

Each (size, variant) runs in its own subprocess with MALLOC_MMAP_THRESHOLD_=65536, so freed tensors return
to the OS and the peak resident set (VmHWM, reset through /proc/self/clear_refs just before the run) minus
the resident set before it is the variant's peak extra memory: activations, workspaces, outputs and
gradients, excluding the inputs. CPU only; on a GPU use torch.cuda.max_memory_allocated instead.

    python benchmarks/kernels/bench_logprob.py            # --quick (default): 2 sizes, ~5-8 min on 2 cores
    python benchmarks/kernels/bench_logprob.py --full     # the issue's grid where it fits in 24 GiB
Writes benchmarks/results/bench_logprob.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)
VARIANTS = ("eager", "compiled", "fused_logits", "fused_linear")
# The issue asks for N in {4096, 16384}, H in {896, 2048}, V in {32k, 152k}. Eager fp32 holds ~4 [N, V]
# tensors at its peak: N=16384 x V=32k (~8 GiB) or N=4096 x V=152k (~10 GiB) does not fit a 24 GiB machine
# shared by several jobs, so the 152k rows use a smaller N and N=16384 is not run.
QUICK = [(4096, 896, 32768), (1024, 896, 151936)]
FULL = [(4096, 896, 32768), (4096, 2048, 32768), (2048, 896, 151936), (2048, 2048, 151936)]
SCALED_NOTE = ("scaled down for a shared 24 GiB / 2-core CPU machine: N=16384 dropped and N<=2048 at V=151936 "
               "(eager would need ~8-10 GiB per run); H and V are the issue's")


# ----------------------------------------------------------------------------------------- child process

def _rss_mib() -> tuple[float, float]:
    with open("/proc/self/status") as f:
        s = f.read()
    hwm = int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) / 1024
    rss = int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024
    return hwm, rss


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    return _rss_mib()[1]


def _steps(variant: str, n: int, h: int, v: int, temperature: float):
    """(train_step, forward_only) closures of one variant over fixed random inputs."""
    import torch

    import verl.ops as O

    torch.manual_seed(0)
    hidden = torch.randn(n, h) * 0.5
    weight = torch.randn(v, h) * (1.0 / h**0.5)
    labels = torch.randint(0, v, (n,))
    a, b = torch.randn(n), torch.randn(n)

    def eager(hd, w, y):
        logits = hd @ w.t()
        logits.div_(temperature)
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        return lp, ent

    fn = {
        "eager": lambda: eager,
        "compiled": lambda: torch.compile(eager),
        "fused_logits": lambda: (lambda hd, w, y: O.logprob_entropy(hd @ w.t(), y, temperature)),
        "fused_linear": lambda: (lambda hd, w, y: O.linear_logprob_entropy(hd, w, y, temperature)),
    }[variant]()
    leaf_h, leaf_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def train_step():
        with O.backend("fused"):
            leaf_h.grad = leaf_w.grad = None
            lp, ent = fn(leaf_h, leaf_w, labels)
            (lp * a + ent * b).sum().backward()
            return lp.detach()

    def forward_only():
        with O.backend("fused"), torch.no_grad():
            return fn(hidden, weight, labels)[0]

    return train_step, forward_only


def _compile_warmup(variant, train_step, forward_only):
    if variant != "compiled":
        return None
    t0 = time.perf_counter()
    train_step()
    forward_only()
    return time.perf_counter() - t0


def _child_mem(variant: str, n: int, h: int, v: int, temperature: float) -> dict:
    """Peak extra resident memory of one fwd+bwd and one forward-only run (subprocess per variant)."""
    train_step, forward_only = _steps(variant, n, h, v, temperature)
    res = {"compile_s": _compile_warmup(variant, train_step, forward_only)}
    for name, step in (("fwd_bwd", train_step), ("fwd", forward_only)):
        base = _reset_peak()
        out = step()
        res[f"{name}_peak_mib"] = _rss_mib()[0] - base
        res[f"{name}_logprob_sum"] = float(out.sum())
        del out
    # Gradients of hidden and W are outputs every variant must hold; shown so a reader sees how much of a
    # fused peak they are.
    res["grad_outputs_mib"] = (n * h + v * h) * 4 / 2**20
    return res


def _child_time(n: int, h: int, v: int, temperature: float, reps: int) -> dict:
    """Seconds per fwd+bwd and per forward, min over `reps` rounds that interleave the variants, so a
    burst of load from other jobs on the shared machine hits every variant alike."""
    steps = {var: _steps(var, n, h, v, temperature) for var in VARIANTS}
    res = {var: {"fwd_bwd_s": float("inf"), "fwd_s": float("inf")} for var in VARIANTS}
    for var, (tr, fw) in steps.items():
        res[var]["compile_s"] = _compile_warmup(var, tr, fw)
    for _ in range(reps):
        for var, (tr, fw) in steps.items():
            for name, step in (("fwd_bwd", tr), ("fwd", fw)):
                t0 = time.perf_counter()
                step()
                res[var][f"{name}_s"] = min(res[var][f"{name}_s"], time.perf_counter() - t0)
    return res


# ----------------------------------------------------------------------------------------------- parent

def _run_child(argv, threads, timeout, malloc_mmap):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if malloc_mmap:  # every freed tensor goes back to the OS, so VmHWM - VmRSS is the true peak
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "--child", *map(str, argv)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"N={r['N']}\nH={r['H']}\nV={r['V']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.2
    for k, (key, title) in enumerate([("fwd_bwd_peak_mib", "peak extra memory, fwd+bwd (MiB)"),
                                      ("fwd_bwd_s", "time fwd+bwd (s)"), ("fwd_s", "time fwd only (s)")]):
        ax = axes[k]
        for i, var in enumerate(VARIANTS):
            vals = [r["variants"].get(var, {}).get(key, float("nan")) for r in rows]
            ax.bar([j + (i - 1.5) * width for j in range(len(rows))], vals, width, label=var)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
        if k == 0:
            ax.set_yscale("log")
            ax.legend(fontsize=8)
    fig.suptitle("verl.ops.linear_logprob_entropy vs eager / torch.compile (CPU, float32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ratios(num: dict, den: dict) -> dict:
    keys = ("fwd_bwd_peak_mib", "fwd_peak_mib", "fwd_bwd_s", "fwd_s")
    return {k: num[k] / den[k] for k in keys if k in num and k in den and den[k]}


def _measure_size(n, h, v, args) -> dict:
    row = {"N": n, "H": h, "V": v, "variants": {var: {} for var in VARIANTS}}
    for var in VARIANTS:
        r = _run_child(["mem", var, n, h, v, args.temperature], args.threads, args.timeout, malloc_mmap=True)
        row["variants"][var].update(r)
    t = _run_child(["time", "-", n, h, v, args.temperature, args.reps], args.threads, args.timeout * 2,
                   malloc_mmap=False)
    for var in VARIANTS:
        row["variants"][var].update(t.get(var, {"time_error": t.get("error", "missing")}))
    for var, r in row["variants"].items():
        if "error" in r or "time_error" in r:
            print(f"  N={n} H={h} V={v} {var:13s} FAILED: {(r.get('error') or r.get('time_error'))[-400:]}",
                  flush=True)
            continue
        print(f"  N={n} H={h} V={v} {var:13s} fwd+bwd {r['fwd_bwd_s']:7.2f}s peak {r['fwd_bwd_peak_mib']:8.0f} MiB"
              f" | fwd {r['fwd_s']:6.2f}s peak {r['fwd_peak_mib']:7.0f} MiB", flush=True)
    e, c, f = (row["variants"][k] for k in ("eager", "compiled", "fused_linear"))
    row["fused_linear_vs_eager"] = _ratios(f, e)
    row["fused_linear_vs_compiled"] = _ratios(f, c)
    if "fwd_bwd_peak_mib" in f and "fwd_bwd_peak_mib" in e:
        g = f["grad_outputs_mib"]  # the same grad_hidden + grad_weight tensors in both
        row["fused_linear_vs_eager"]["fwd_bwd_peak_excl_grads"] = (
            (f["fwd_bwd_peak_mib"] - g) / max(e["fwd_bwd_peak_mib"] - g, 1e-9))
        row["logprob_sum_abs_diff_vs_eager"] = abs(f["fwd_bwd_logprob_sum"] - e["fwd_bwd_logprob_sum"])
    for name, rr in (("eager", row["fused_linear_vs_eager"]), ("torch.compile", row["fused_linear_vs_compiled"])):
        print(f"  -> fused_linear / {name}: " + ", ".join(f"{k} {val:.3f}" for k, val in rr.items()), flush=True)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, variant = sys.argv[2], sys.argv[3]
        n, h, v, t = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
        out = _child_mem(variant, n, h, v, t) if kind == "mem" else _child_time(n, h, v, t, int(sys.argv[8]))
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two sizes (default)")
    mode.add_argument("--full", action="store_true", help="the issue's grid, scaled where it does not fit")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="interleaved timing rounds (min is reported)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per subprocess")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    sizes = FULL if args.full else QUICK
    print(f"[bench_logprob] {SCALED_NOTE}", flush=True)
    t0 = time.time()
    rows = [_measure_size(n, h, v, args) for n, h, v in sizes]
    import torch
    meta = {"command": "python benchmarks/kernels/bench_logprob.py" + (" --full" if args.full else ""),
            "note": SCALED_NOTE, "dtype": "float32", "device": "cpu", "threads": args.threads,
            "temperature": args.temperature, "torch": torch.__version__, "machine": platform.processor() or
            platform.machine(), "load_avg_1m_at_end": os.getloadavg()[0], "wall_s": time.time() - t0,
            "memory": "peak extra resident set per variant in its own process (MALLOC_MMAP_THRESHOLD_=65536)",
            "timing": f"min over {args.reps} interleaved rounds in one process; the machine is shared, so "
                      "expect noise of tens of percent", "fused_linear_chunks": "chunk_n=1024, chunk_v=4096"}
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "bench_logprob.json")
    with open(out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    _plot(rows, os.path.join(args.out_dir, "bench_logprob.png"))
    print(f"[bench_logprob] wrote {out} and bench_logprob.png ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
