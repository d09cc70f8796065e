"""Dataflow scheduling overhead, side by side with calling the same functions directly.

    python benchmarks/dataflow/bench_overhead.py --quick      # ~20 s on a shared CPU
    python benchmarks/dataflow/bench_overhead.py --full

Measures, single process (colocated placement, no redistribution):
  1. chains of 10 and 100 empty nodes: µs per node for `Dataflow.run` versus a plain Python loop calling the
     same functions (the baseline), and the difference (the scheduler's own cost); also with tracing on and
     for the dict form (`verl.run(dict, ...)`, which builds the graph on every call).
  2. an injected no-op `CustomNode` relative to a realistic step: a PPO-style update (forward, clipped
     policy loss, backward, AdamW step) of a small torch MLP policy, run as a node with and without a no-op
     injected before it. The injected node's cost is also timed alone (a flow of just that node), because
     its microseconds are far below the step's run-to-run noise.
Writes benchmarks/results/dataflow_overhead.json and .png.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import verl  # noqa: E402
from verl import CustomNode, DataflowNode, build_dataflow, inject_node  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results")


def _empty_chain(n: int):
    nodes, fns = {}, []
    for i in range(n):
        def fn(**kw):
            return 0
        fns.append(fn)
        nodes[f"n{i}"] = DataflowNode(input_keys=["x"] if i == 0 else [f"k{i - 1}"], output_keys=[f"k{i}"])(fn)
    return nodes, fns


def _median_s(fn, repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls."""
    return _timings(fn, repeats, inner)[0]


def _timings(fn, repeats: int, inner: int) -> tuple[float, float]:
    """(median, best) seconds per call; the best is timeit's estimate on a machine shared with other jobs."""
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples), min(samples)


def bench_chains(repeats: int, trace_dir: str) -> list[dict]:
    rows = []
    for n in (10, 100):
        nodes, fns = _empty_chain(n)
        flow = build_dataflow(nodes=nodes)
        inner = max(1, 2000 // n)

        def direct():
            v = 0
            for f in fns:
                v = f(x=v)
            return v

        t_direct, best_direct = _timings(direct, repeats, inner)
        t_run, best_run = _timings(lambda: flow.run({"x": 0}), repeats, inner)
        as_dict = dict(nodes)
        t_dict = _median_s(lambda: verl.run(as_dict, {"x": 0}), max(3, repeats // 3), max(1, inner // 10))
        path = os.path.join(trace_dir, f"chain{n}.json")
        t_trace = _median_s(lambda: flow.run({"x": 0}, trace=path), max(3, repeats // 3), 1)
        rows.append({"nodes": n, "direct_us_per_node": t_direct / n * 1e6, "run_us_per_node": t_run / n * 1e6,
                     "overhead_us_per_node": (t_run - t_direct) / n * 1e6,
                     "best_run_us_per_node": best_run / n * 1e6, "best_direct_us_per_node": best_direct / n * 1e6,
                     "dict_form_us_per_node": t_dict / n * 1e6, "traced_us_per_node": t_trace / n * 1e6,
                     "ratio_run_vs_direct": t_run / t_direct})
    return rows


class Policy(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, hidden),
                                       torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, vocab))

    def forward(self, ids):
        return self.net(ids)


@DataflowNode(input_keys=["tokens", "old_log_probs", "advantages", "actor", "optimizer"], output_keys=["loss"])
def ppo_step(tokens, old_log_probs, advantages, actor, optimizer, clip=0.2):
    logits = actor(tokens[:, :-1]).float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(log_probs - old_log_probs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


@DataflowNode(input_keys=["tokens"], output_keys=["advantages"])
def compute_advantage(tokens):
    return torch.ones(tokens.shape[0], tokens.shape[1] - 1)


@CustomNode()
def noop_filter(advantages):
    return dict(advantages=advantages)


def bench_injection(repeats: int, batch: int, seq: int, hidden: int) -> dict:
    torch.manual_seed(0)
    vocab = 512
    actor = Policy(vocab, hidden)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    tokens = torch.randint(0, vocab, (batch, seq))
    inputs = {"tokens": tokens, "old_log_probs": torch.full((batch, seq - 1), -6.0), "actor": actor, "optimizer": opt}
    base = build_dataflow(nodes=[compute_advantage, ppo_step])
    injected = inject_node(base_dataflow=base, node=noop_filter, after="compute_advantage", before="ppo_step")
    alone = build_dataflow(nodes=[noop_filter])
    adv = {"advantages": torch.ones(batch, seq - 1)}
    for _ in range(3):
        base.run(inputs)
        injected.run(inputs)
    # Interleave A and B so that drift on the shared machine hits both alike.
    a, b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        base.run(inputs)
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        injected.run(inputs)
        b.append(time.perf_counter() - t)
    step_s = statistics.median(a)
    node_s, node_best_s = _timings(lambda: alone.run(adv), 20, 500)
    article_step_s = 0.87e-3 / 0.00015  # the article: 0.87 ms per custom node = 0.015% of its PPO step
    return {"batch": batch, "seq": seq, "hidden": hidden,
            "params": sum(p.numel() for p in actor.parameters()),
            "step_ms_base": step_s * 1e3, "step_ms_with_injected_noop": statistics.median(b) * 1e3,
            "ab_difference_ms": (statistics.median(b) - step_s) * 1e3,
            "step_ms_spread_iqr": (statistics.quantiles(a, n=4)[2] - statistics.quantiles(a, n=4)[0]) * 1e3,
            "injected_node_us": node_s * 1e6, "injected_node_best_us": node_best_s * 1e6,
            "injected_fraction_of_step_pct": node_s / step_s * 100,
            "article_step_s": article_step_s, "article_node_ms": 0.87,
            "injected_fraction_of_article_step_pct": node_s / article_step_s * 100}


def _dist_body(rank, world_size, n, repeats):
    nodes, _ = _empty_chain(n)
    flow = build_dataflow(nodes=nodes)
    out = {}
    for mode in ("node", "end"):
        t, best = _timings(lambda: flow.run({"x": 0}, check_errors=mode), repeats, 5)
        out[mode] = (t / n * 1e6, best / n * 1e6)
    return out


def bench_distributed(n: int, repeats: int, world: int = 4) -> dict:
    """Per-node cost of a colocated chain on ``world`` gloo CPU ranks: with the per-node error agreement (one
    int all-reduce) and with errors checked once per run."""
    from verl.testing import run_distributed
    res = run_distributed(_dist_body, world_size=world, args=(n, repeats), timeout=300)
    return {"world_size": world, "nodes": n,
            "check_node_us_per_node": statistics.median(r["node"][0] for r in res),
            "check_end_us_per_node": statistics.median(r["end"][0] for r in res)}


def plot(chains: list[dict], inj: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    labels = [f"{r['nodes']} nodes" for r in chains]
    series = [("direct call", "direct_us_per_node"), ("Dataflow.run", "run_us_per_node"),
              ("run + trace (writes the file)", "traced_us_per_node"),
              ("dict form (builds each call)", "dict_form_us_per_node")]
    width = 0.2
    for i, (name, key) in enumerate(series):
        ax1.bar([x + i * width for x in range(len(chains))], [r[key] for r in chains], width, label=name)
    ax1.axhline(20, color="red", ls="--", lw=1, label="target 20 µs")
    ax1.set_xticks([x + 1.5 * width for x in range(len(chains))], labels)
    ax1.set_ylabel("µs per node (median)")
    ax1.set_yscale("log")
    ax1.set_title("Scheduling cost per empty node, colocated")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    ax2.bar(["PPO-style step\n(fwd+bwd+AdamW)", "injected no-op\nnode"],
            [inj["step_ms_base"] * 1e3, inj["injected_node_us"]], color=["tab:gray", "tab:orange"])
    ax2.set_yscale("log")
    ax2.set_ylabel("µs (median)")
    ax2.set_title(f"Injected node = {inj['injected_fraction_of_step_pct']:.4f}% of a "
                  f"{inj['step_ms_base']:.1f} ms step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small repeat counts (default)")
    mode.add_argument("--full", action="store_true", help="more repeats and a bigger step")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--no-distributed", action="store_true", help="skip the 4-rank gloo measurement")
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    torch.set_num_threads(1 if not args.full else max(1, min(4, os.cpu_count() or 1)))
    repeats = 40 if args.full else 15
    os.makedirs(args.out, exist_ok=True)
    trace_dir = os.path.join(args.out, "tmp_traces")
    os.makedirs(trace_dir, exist_ok=True)
    chains = bench_chains(repeats, trace_dir)
    for f in os.listdir(trace_dir):
        os.remove(os.path.join(trace_dir, f))
    os.rmdir(trace_dir)
    inj = bench_injection(repeats=30 if args.full else 12, batch=32 if args.full else 16, seq=128 if args.full else 64,
                          hidden=512 if args.full else 256)
    dist_row = None if args.no_distributed else bench_distributed(20, 10 if args.full else 5)
    result = {"benchmark": "dataflow_overhead", "mode": "full" if args.full else "quick",
              "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "chains": chains, "injection": inj, "distributed": dist_row, "target_us_per_node": 20.0,
              "target_injected_pct": 0.01}
    write_result(os.path.join(args.out, "dataflow_overhead.json"), result, run_info)
    plot(chains, inj, os.path.join(args.out, "dataflow_overhead.png"))
    for r in chains:
        print(f"chain of {r['nodes']:>3}: run {r['run_us_per_node']:.2f} µs/node, "
              f"direct {r['direct_us_per_node']:.2f}, "
              f"overhead {r['overhead_us_per_node']:.2f} µs/node (best {r['best_run_us_per_node']:.2f}); traced "
              f"{r['traced_us_per_node']:.1f}; dict form {r['dict_form_us_per_node']:.1f}")
    if dist_row:
        print(f"{dist_row['world_size']} gloo ranks, chain of {dist_row['nodes']}: "
              f"{dist_row['check_node_us_per_node']:.0f} µs/node with per-node error agreement, "
              f"{dist_row['check_end_us_per_node']:.1f} µs/node with check_errors='end'")
    print(f"PPO-style step {inj['step_ms_base']:.2f} ms "
          f"(A/B with injected no-op: {inj['step_ms_with_injected_noop']:.2f} ms); "
          f"injected node alone {inj['injected_node_us']:.2f} µs = {inj['injected_fraction_of_step_pct']:.4f}% of this "
          f"step, {inj['injected_fraction_of_article_step_pct']:.6f}% of the article's "
          f"{inj['article_step_s']:.1f} s step")


if __name__ == "__main__":
    main()
