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


def _child(variant: str, n: int, h: int, v: int, temperature: float) -> dict:
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

    fns = {
        "eager": eager,
        "compiled": torch.compile(eager),
        "fused_logits": lambda hd, w, y: O.logprob_entropy(hd @ w.t(), y, temperature),
        "fused_linear": lambda hd, w, y: O.linear_logprob_entropy(hd, w, y, temperature),
    }
    fn = fns[variant]
    with O.backend("fused"):
        leaf_h, leaf_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def train_step():
            hd, w = leaf_h, leaf_w
            hd.grad = w.grad = None
            lp, ent = fn(hd, w, labels)
            (lp * a + ent * b).sum().backward()
            return lp.detach(), hd.grad, w.grad

        def forward_only():
            with torch.no_grad():
                return fn(hidden, weight, labels)

        compile_s = None
        if variant == "compiled":  # compile both graphs before measuring
            t0 = time.perf_counter()
            train_step()
            forward_only()
            compile_s = time.perf_counter() - t0
        res = {}
        for name, step in (("fwd_bwd", train_step), ("fwd", forward_only)):
            base = _reset_peak()
            t0 = time.perf_counter()
            out = step()
            res[f"{name}_s"] = time.perf_counter() - t0
            res[f"{name}_peak_mib"] = _rss_mib()[0] - base
            if name == "fwd_bwd":
                res["logprob_sum"] = float(out[0].sum())
            del out
    # Gradients of hidden and W are outputs every variant must hold: report them so a reader can see
    # how much of a fused peak they are.
    res["grad_outputs_mib"] = (n * h + v * h) * 4 / 2**20
    res["compile_s"] = compile_s
    return res


# ----------------------------------------------------------------------------------------------- parent

def _run_child(variant, n, h, v, temperature, threads, timeout):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--child", variant, str(n), str(h), str(v), str(temperature)]
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        variant, n, h, v, t = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
        print(json.dumps(_child(variant, n, h, v, t)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two sizes (default)")
    mode.add_argument("--full", action="store_true", help="the issue's grid, scaled where it does not fit")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per (size, variant) subprocess")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    sizes = FULL if args.full else QUICK
    print(f"[bench_logprob] {SCALED_NOTE}", flush=True)
    rows = []
    for n, h, v in sizes:
        row = {"N": n, "H": h, "V": v, "variants": {}}
        for var in VARIANTS:
            r = _run_child(var, n, h, v, args.temperature, args.threads, args.timeout)
            row["variants"][var] = r
            if "error" in r:
                print(f"  N={n} H={h} V={v} {var:13s} FAILED: {r['error'][-300:]}", flush=True)
            else:
                print(f"  N={n} H={h} V={v} {var:13s} fwd+bwd {r['fwd_bwd_s']:7.2f}s peak {r['fwd_bwd_peak_mib']:8.0f} "
                      f"MiB | fwd {r['fwd_s']:6.2f}s peak {r['fwd_peak_mib']:7.0f} MiB", flush=True)
        e, f = row["variants"]["eager"], row["variants"]["fused_linear"]
        c = row["variants"]["compiled"]
        if "error" not in e and "error" not in f:
            row["ratios_fused_linear_vs_eager"] = {
                "peak_mem_fwd_bwd": f["fwd_bwd_peak_mib"] / e["fwd_bwd_peak_mib"],
                "peak_mem_fwd": f["fwd_peak_mib"] / e["fwd_peak_mib"],
                "time_fwd_bwd": f["fwd_bwd_s"] / e["fwd_bwd_s"],
                "time_fwd": f["fwd_s"] / e["fwd_s"],
                "logprob_sum_abs_diff": abs(f["logprob_sum"] - e["logprob_sum"]),
            }
            print(f"  -> fused_linear / eager: peak mem fwd+bwd {row['ratios_fused_linear_vs_eager']['peak_mem_fwd_bwd']:.3f}"
                  f", fwd {row['ratios_fused_linear_vs_eager']['peak_mem_fwd']:.3f}; time fwd+bwd "
                  f"{row['ratios_fused_linear_vs_eager']['time_fwd_bwd']:.2f}, fwd {row['ratios_fused_linear_vs_eager']['time_fwd']:.2f}",
                  flush=True)
        if "error" not in c and "error" not in f:
            row["ratios_fused_linear_vs_compiled"] = {
                "peak_mem_fwd_bwd": f["fwd_bwd_peak_mib"] / c["fwd_bwd_peak_mib"],
                "time_fwd_bwd": f["fwd_bwd_s"] / c["fwd_bwd_s"], "time_fwd": f["fwd_s"] / c["fwd_s"]}
        rows.append(row)
    import torch
    meta = {"command": "python benchmarks/kernels/bench_logprob.py" + (" --full" if args.full else ""),
            "note": SCALED_NOTE, "dtype": "float32", "device": "cpu", "threads": args.threads,
            "temperature": args.temperature, "torch": torch.__version__, "machine": platform.processor() or
            platform.machine(), "load_avg_1m_at_end": os.getloadavg()[0],
            "timing": "one measured run per variant (shared machine: expect +-20% noise between runs)"}
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "bench_logprob.json")
    with open(out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    _plot(rows, os.path.join(args.out_dir, "bench_logprob.png"))
    print(f"[bench_logprob] wrote {out} and bench_logprob.png")


if __name__ == "__main__":
    main()
