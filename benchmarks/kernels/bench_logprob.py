"""Peak memory and time of per-token log-prob + entropy from the LM head: fused vs eager vs torch.compile.

Variants, all computing (logprob, entropy) of labels under softmax(hidden @ W.T / T), forward + backward
of loss = sum(logprob * a + entropy * b) w.r.t. hidden and W:
  eager          h @ W.T, div_ by T, log_softmax, gather, entropy = -(exp(logp) * logp).sum (what verl did)
  compiled       torch.compile (inductor) of `eager`; its compile run is excluded from the figures
  fused_logits   h @ W.T, then verl.ops.logprob_entropy (the streaming kernel on materialised logits)
  fused_linear   verl.ops.linear_logprob_entropy (chunked GEMMs; logits never whole)

With --loss, the whole RL loss head instead (the actor's loss: log-prob and entropy at a temperature, PPO clip with
dual clip, low_var_kl to reference log-probs, entropy bonus, token-mean over a mask with holes; forward +
backward w.r.t. hidden and W):
  loss_eager     logits = h @ W.T, / T, log_softmax, gather, entropy, the loss in plain torch ops, backward
  loss_compiled  torch.compile (inductor) of `loss_eager`
  loss_fused     verl.ops.linear_rl_loss (3 GEMMs, d loss / d h and d loss / d W in its forward pass)
Reported per size: median over --reps interleaved rounds, and the three ratios fused / eager time, fused / eager
peak memory, fused / compiled time. Written to bench_loss_head.json / .png.

    python benchmarks/kernels/bench_logprob.py --loss --full --reps 3    # the issue's grid

Each (size, variant) runs in its own subprocess with MALLOC_MMAP_THRESHOLD_=65536, so freed tensors return
to the OS and the peak resident set (VmHWM, reset through /proc/self/clear_refs just before the run) minus
the resident set before it is the variant's peak extra memory: activations, workspaces, outputs and
gradients, excluding the inputs. CPU only; on a GPU use torch.cuda.max_memory_allocated instead.

Time: one thread by default, and the figure compared is the thread's CPU time (time.thread_time), with
wall time recorded beside it. The machine is shared by several jobs: a descheduled thread's wall time
measures the neighbours, and with 2 threads one descheduled OpenMP thread stalls the other at every
barrier (earlier 2-thread runs here took 2-3x the 1-thread time). `--threads 2` measures wall time.

    python benchmarks/kernels/bench_logprob.py            # --quick (default): N=4096, H=896, V 32k and 152k
    python benchmarks/kernels/bench_logprob.py --full     # adds H=2048
    python benchmarks/kernels/bench_logprob.py --sizes 256x64x1000   # a smoke run of one small size
Sizes whose eager run would not fit in the memory available at start are scaled down in N (the output
says which). Writes benchmarks/results/bench_logprob.json and .png.
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
LOSS_VARIANTS = ("loss_eager", "loss_compiled", "loss_fused")
_SETS = {"logprob": VARIANTS, "loss": LOSS_VARIANTS}
# The issue asks for N in {4096, 16384}, H in {896, 2048}, V in {32k, 152k}. Eager fp32 holds ~5 [N, V]
# tensors at its peak (measured: 2.5 GiB at N=4096, V=32k), so N=16384 (10-48 GiB) never fits this 24 GiB
# machine; N=4096 at V=152k (~12 GiB) is run when the memory available at start allows, else N is halved
# until it does.
QUICK = [(4096, 896, 32768), (4096, 896, 151936)]
FULL = QUICK + [(4096, 2048, 32768), (4096, 2048, 151936)]
EAGER_NV_TENSORS = 5.5  # [N, V] float32 tensors live at eager's fwd+bwd peak, with margin
SCALED_NOTE = "N=16384 dropped: eager would need 10-48 GiB on this shared 24 GiB / 2-core CPU machine"


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1)) / 2**20


def _fit(n: int, h: int, v: int, avail_gib: float) -> int:
    """Largest N <= n (halving) whose eager fwd+bwd plus inputs fit in 80% of the available memory."""
    def need(rows):
        return (EAGER_NV_TENSORS * rows * v + 4 * v * h + 4 * rows * h) * 4 / 2**30
    while n > 256 and need(n) > 0.8 * avail_gib:
        n //= 2
    return n


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


def _inputs(n: int, h: int, v: int) -> dict:
    """Fixed random inputs, shared by every variant in a process (at V=152k the weight alone is 0.5 GiB)."""
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(n, h) * 0.5
    weight = torch.randn(v, h) * (1.0 / h**0.5)
    b = max(1, n // 512)  # sequences of 512 response tokens; every 7th token of the first half masked (holes)
    mask = torch.ones(b, n // b)
    mask.view(-1)[: n // 2: 7] = 0
    rl = {"mask": mask, "adv": torch.randn(b, n // b), "old": torch.randn(b, n // b) * 0.1 - 11.0,
          "ref": torch.randn(b, n // b) * 0.1 - 11.0}
    return {**rl, "hidden": hidden, "weight": weight, "labels": torch.randint(0, v, (n,)), "a": torch.randn(n),
            "b": torch.randn(n), "leaf_h": hidden.clone().requires_grad_(),
            "leaf_w": weight.clone().requires_grad_()}


def _steps(variant: str, x: dict, temperature: float):
    """(train_step, forward_only) closures of one variant over the shared inputs `x`."""
    import torch

    import verl.ops as O

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
    leaf_h, leaf_w, labels, a, b = x["leaf_h"], x["leaf_w"], x["labels"], x["a"], x["b"]

    def train_step():
        with O.backend("fused"):
            leaf_h.grad = leaf_w.grad = None
            lp, ent = fn(leaf_h, leaf_w, labels)
            (lp * a + ent * b).sum().backward()
            return lp.detach()

    def forward_only():
        with O.backend("fused"), torch.no_grad():
            return fn(x["hidden"], x["weight"], labels)[0]

    return train_step, forward_only


LOSS_KW = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0, kl_coef=0.001, entropy_coeff=0.01)
"""The loss head's settings in every loss benchmark (here and benchmarks/kernels/bench_gpu.py)."""


def eager_rl_loss(hd, w, y, mask, adv, old, ref, temperature: float):
    """The actor's loss as eager PyTorch writes it (the baseline, and what torch.compile compiles): logits,
    log-softmax, PPO dual clip, k3 KL to the reference and the entropy bonus, token-mean over `mask`.
    Returns (loss, masked log-probs [B, T])."""
    import torch
    kw = LOSS_KW
    logp = torch.log_softmax((hd @ w.t()).float() / temperature, dim=-1)  # the usual upcast (no-op in fp32)
    lp = logp.gather(-1, y.reshape(-1, 1)).view(mask.shape)
    ent = -(logp.exp() * logp).sum(-1).view(mask.shape)
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - kw["clip_low"], 1 + kw["clip_high"]))
    pg = torch.where(adv < 0, torch.minimum(clipped, -adv * kw["clip_c"]), clipped)
    dr = torch.clamp(ref - lp, -20.0, 20.0)
    kl = torch.clamp(dr.exp() - dr - 1, -10.0, 10.0)
    per_token = pg + kw["kl_coef"] * kl - kw["entropy_coeff"] * ent
    return (per_token * mask).sum() / mask.sum(), lp * mask


def _loss_steps(variant: str, x: dict, temperature: float):
    """(train_step, None) of one --loss variant: the actor's whole loss, forward + backward."""
    import torch

    import verl.ops as O
    mask, adv, old, ref = x["mask"], x["adv"], x["old"], x["ref"]
    labels = x["labels"].view(mask.shape)
    kw = LOSS_KW

    def eager(hd, w, y):
        return eager_rl_loss(hd, w, y, mask, adv, old, ref, temperature)

    def fused(hd, w, y):
        out = O.linear_rl_loss(hd, w, y, mask, adv, old_logprob=old, ref_logprob=ref, temperature=temperature,
                               loss_type="vanilla", **kw)
        return out.loss, out.log_probs

    fn = {"loss_eager": lambda: eager, "loss_compiled": lambda: torch.compile(eager),
          "loss_fused": lambda: fused}[variant]()
    leaf_h, leaf_w = x["leaf_h"], x["leaf_w"]

    def train_step():
        with O.backend("fused"):
            leaf_h.grad = leaf_w.grad = None
            loss, lp = fn(leaf_h, leaf_w, labels)
            loss.backward()
            return lp.detach()

    return train_step, None


def _clock(threads: int):
    """CPU time of this thread with one thread (immune to time slicing by other jobs), else wall time."""
    return time.thread_time if threads == 1 else time.perf_counter


def _compile_warmup(variant, train_step, forward_only):
    if variant not in ("compiled", "loss_compiled"):
        return None
    t0 = time.perf_counter()
    train_step()
    if forward_only is not None:
        forward_only()
    return time.perf_counter() - t0


def _child_mem(variant: str, n: int, h: int, v: int, temperature: float) -> dict:
    """Peak extra resident memory of one fwd+bwd and one forward-only run (subprocess per variant)."""
    x = _inputs(n, h, v)
    train_step, forward_only = (_loss_steps if variant in LOSS_VARIANTS else _steps)(variant, x, temperature)
    res = {"compile_s": _compile_warmup(variant, train_step, forward_only)}
    for name, step in (("fwd_bwd", train_step), ("fwd", forward_only)):
        if step is None:
            continue
        x["leaf_h"].grad = x["leaf_w"].grad = None
        base = _reset_peak()
        out = step()
        res[f"{name}_peak_mib"] = _rss_mib()[0] - base
        res[f"{name}_logprob_sum"] = float(out.sum())
        del out
    # Gradients of hidden and W are outputs every variant must hold; shown so a reader sees how much of a
    # fused peak they are.
    res["grad_outputs_mib"] = (n * h + v * h) * 4 / 2**20
    return res


def _child_time(n: int, h: int, v: int, temperature: float, reps: int, threads: int, which: str = "logprob") -> dict:
    """Seconds per fwd+bwd and per forward, min over `reps` rounds that interleave the variants, so a
    burst of load from other jobs on the shared machine hits every variant alike. `*_s` is the compared
    figure (thread CPU time with 1 thread, else wall time); `*_wall_s` is always wall time."""
    clock = _clock(threads)
    import statistics
    x = _inputs(n, h, v)
    names = _SETS[which]
    steps = {var: (_loss_steps if which == "loss" else _steps)(var, x, temperature) for var in names}
    res = {var: {k: float("inf") for k in ("fwd_bwd_s", "fwd_s", "fwd_bwd_wall_s", "fwd_wall_s")}
           for var in names}
    samples = {var: [] for var in names}
    for var, (tr, fw) in steps.items():
        res[var]["compile_s"] = _compile_warmup(var, tr, fw)
    for _ in range(reps):
        for var, (tr, fw) in steps.items():
            for name, step in (("fwd_bwd", tr), ("fwd", fw)):
                if step is None:
                    continue
                x["leaf_h"].grad = x["leaf_w"].grad = None  # the previous variant's gradients
                w0, c0 = time.perf_counter(), clock()
                out = step()
                c1, w1 = clock(), time.perf_counter()
                del out
                res[var][f"{name}_s"] = min(res[var][f"{name}_s"], c1 - c0)
                res[var][f"{name}_wall_s"] = min(res[var][f"{name}_wall_s"], w1 - w0)
                if name == "fwd_bwd":
                    samples[var].append(c1 - c0)
    for var in names:
        res[var]["fwd_bwd_samples_s"] = samples[var]
        res[var]["fwd_bwd_median_s"] = statistics.median(samples[var]) if samples[var] else float("nan")
        res[var] = {k: val for k, val in res[var].items() if val != float("inf")}
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
    keys = ("fwd_bwd_peak_mib", "fwd_peak_mib", "fwd_bwd_s", "fwd_s", "fwd_bwd_wall_s", "fwd_wall_s")
    return {k: num[k] / den[k] for k in keys if k in num and k in den and den[k]}


def _measure_size(n, h, v, args) -> dict:
    row = {"N": n, "H": h, "V": v, "variants": {var: {} for var in VARIANTS}}
    for var in VARIANTS:
        r = _run_child(["mem", var, n, h, v, args.temperature], args.threads, args.timeout, malloc_mmap=True)
        row["variants"][var].update(r)
    t = _run_child(["time", "-", n, h, v, args.temperature, args.reps, args.threads], args.threads,
                   args.timeout * 2, malloc_mmap=False)
    for var in VARIANTS:
        row["variants"][var].update(t.get(var, {"time_error": t.get("error", "missing")}))
    for var, r in row["variants"].items():
        if "error" in r or "time_error" in r:
            print(f"  N={n} H={h} V={v} {var:13s} FAILED: {(r.get('error') or r.get('time_error'))[-400:]}",
                  flush=True)
            continue
        print(f"  N={n} H={h} V={v} {var:13s} fwd+bwd {r['fwd_bwd_s']:7.2f}s peak {r['fwd_bwd_peak_mib']:8.0f} MiB"
              f" | fwd {r['fwd_s']:6.2f}s peak {r['fwd_peak_mib']:7.0f} MiB | wall {r['fwd_bwd_wall_s']:7.2f}s"
              f" {r['fwd_wall_s']:6.2f}s", flush=True)
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


def _measure_loss_size(n, h, v, args) -> dict:
    """The --loss row of one size: peak memory per variant (own process), then interleaved timing rounds."""
    row = {"N": n, "H": h, "V": v, "variants": {var: {} for var in LOSS_VARIANTS}}
    for var in LOSS_VARIANTS:
        row["variants"][var].update(_run_child(["mem", var, n, h, v, args.temperature], args.threads, args.timeout,
                                               malloc_mmap=True))
    t = _run_child(["time", "loss", n, h, v, args.temperature, args.reps, args.threads], args.threads,
                   args.timeout * 2, malloc_mmap=False)
    for var in LOSS_VARIANTS:
        row["variants"][var].update(t.get(var, {"time_error": t.get("error", "missing")}))
    e, c, f = (row["variants"][k] for k in LOSS_VARIANTS)
    bad = [k for k, r in row["variants"].items() if "error" in r or "time_error" in r]
    if bad:
        print(f"  N={n} H={h} V={v} FAILED {bad}: {str(row['variants'][bad[0]])[-600:]}", flush=True)
        return row
    row["ratios"] = {"time_fused_vs_eager": f["fwd_bwd_median_s"] / e["fwd_bwd_median_s"],
                     "peak_mem_fused_vs_eager": f["fwd_bwd_peak_mib"] / e["fwd_bwd_peak_mib"],
                     "time_fused_vs_compiled": f["fwd_bwd_median_s"] / c["fwd_bwd_median_s"],
                     # both hold the same grad_hidden + grad_weight outputs; the rest is each variant's own
                     "peak_mem_fused_vs_eager_excl_grads": (f["fwd_bwd_peak_mib"] - f["grad_outputs_mib"])
                     / (e["fwd_bwd_peak_mib"] - e["grad_outputs_mib"]),
                     "loss_logprob_sum_abs_diff_vs_eager": abs(f["fwd_bwd_logprob_sum"] - e["fwd_bwd_logprob_sum"])}
    for var, r in row["variants"].items():
        print(f"  N={n} H={h} V={v} {var:14s} fwd+bwd median {r['fwd_bwd_median_s']:7.2f}s "
              f"(samples {', '.join(f'{x:.2f}' for x in r['fwd_bwd_samples_s'])}) peak {r['fwd_bwd_peak_mib']:8.0f} MiB",
              flush=True)
    print("  -> " + ", ".join(f"{k} {val:.3f}" for k, val in row["ratios"].items()), flush=True)
    return row


def _plot_loss(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "ratios" in r]
    labels = [f"H={r['H']}\nV={r['V']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, (key, title) in enumerate([("fwd_bwd_median_s", "fwd+bwd time, median (s)"),
                                      ("fwd_bwd_peak_mib", "peak extra memory, fwd+bwd (MiB)")]):
        ax = axes[k]
        for i, var in enumerate(LOSS_VARIANTS):
            vals = [r["variants"][var].get(key, float("nan")) for r in rows]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(rows))], vals, 0.27, label=var)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("fused RL loss head (verl.ops.linear_rl_loss) vs eager / torch.compile, CPU float32, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, variant = sys.argv[2], sys.argv[3]
        n, h, v, t = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
        out = (_child_mem(variant, n, h, v, t) if kind == "mem"
               else _child_time(n, h, v, t, int(sys.argv[8]), int(sys.argv[9]), variant if variant != "-" else "logprob"))
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two sizes (default)")
    mode.add_argument("--full", action="store_true", help="the issue's grid, scaled where it does not fit")
    ap.add_argument("--loss", action="store_true",
                    help="the whole RL loss head (fused linear_rl_loss vs eager vs torch.compile), see above")
    mode.add_argument("--sizes", nargs="+", metavar="NxHxV", help="explicit sizes, e.g. 256x64x1000 (smoke runs)")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 (default) compares CPU time, more compares wall time")
    ap.add_argument("--reps", type=int, default=2, help="interleaved timing rounds (min is reported)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per subprocess")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo
    args.run_info = RunInfo.start()  # one run, one results file: sizes are measured together, never merged
    if args.sizes:
        asked = [tuple(int(d) for d in s.split("x")) for s in args.sizes]
    else:
        asked = FULL if args.full else QUICK
    avail = _mem_available_gib()
    sizes, notes = [], [SCALED_NOTE] if not args.sizes else []
    for n, h, v in asked:
        fit = _fit(n, h, v, avail)
        if fit != n:
            notes.append(f"N={n} H={h} V={v} scaled to N={fit}: eager would not fit in the {avail:.1f} GiB "
                         f"available at start")
        sizes.append((fit, h, v))
    note = "; ".join(notes) or "no size scaled down"
    print(f"[bench_logprob] sizes {sizes}; {note}", flush=True)
    rows = []
    for i, (n, h, v) in enumerate(sizes):
        rows.append(_measure_loss_size(n, h, v, args) if args.loss else _measure_size(n, h, v, args))
        # Written after every size (meta.complete says whether all were), so a run cut short by its time
        # limit still leaves the finished rows.
        _write(rows, args, note, avail, complete=i == len(sizes) - 1)


def _write(rows, args, note, avail, complete):
    """JSON + PNG of this run's rows."""
    import verl.ops as O
    from verl.utils.results import write_result
    meta = {"note": note, "complete": complete, "mem_available_gib_at_start": avail, "dtype": "float32",
            "device": "cpu", "threads": args.threads, "temperature": args.temperature,
            "processor": platform.processor() or platform.machine(),
            "memory": "peak extra resident set per variant in its own process (MALLOC_MMAP_THRESHOLD_=65536)",
            "timing": (f"min over {args.reps} interleaved rounds in one process; *_s = "
                       + ("thread CPU time" if args.threads == 1 else "wall time") + ", *_wall_s = wall time"),
            "fused_linear_chunks": f"chunk_n={O.DEFAULT_CHUNK_N}, chunk_v={O.DEFAULT_CHUNK_V} (the defaults)"}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = "bench_loss_head" if args.loss else "bench_logprob"
    if args.loss:
        meta["timing"] = (f"median over {args.reps} interleaved rounds in one process, thread CPU time "
                          f"(fwd_bwd_samples_s lists them)")
        meta["fused_linear_chunks"] = ("linear_rl_loss chunk_n=0: on CPU max(192, 6 * 2^20 / V) rows per chunk "
                                       "(24 MiB of float32 logits at V=32k, 111 MiB at V=152k)")
    out = os.path.join(args.out_dir, stem + ".json")
    written = write_result(out, {"rows": rows}, args.run_info, **meta)
    (_plot_loss if args.loss else _plot)(rows, os.path.join(args.out_dir, stem + ".png"))
    print(f"[bench_logprob] wrote {out} and {stem}.png ({written['meta']['wall_s']:.0f}s)", flush=True)

if __name__ == "__main__":
    main()
