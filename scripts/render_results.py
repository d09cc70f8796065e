"""Turns benchmarks/results/*.json into docs/benchmarks.md and into the figures README.md and the docs pages
quote, so that no benchmark figure in the docs is typed by hand (tests/test_docs_rendered.py fails when a doc
differs from what this renders).

    python scripts/render_results.py            # rewrite docs/benchmarks.md and every page's figure spans
    python scripts/render_results.py --check    # exit 1, naming each doc that differs from what it renders

docs/benchmarks.md is written whole. In README.md and every other docs/*.md (figure_pages()) a figure is a span
`<!-- fig:NAME -->...<!-- /fig -->` whose text FIGURES[NAME] renders from the results; only those spans are
rewritten, and every name in FIGURES is quoted somewhere. Every results file is rendered with
its provenance (meta.command, commit, machine load; verl.utils.results); files written before the benchmarks
recorded it are listed in LEGACY with what is missing, so a reader knows which figures cannot be reproduced
from their file alone. Traces (Chrome trace-event JSON) are listed, not tabulated.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def figure_pages(root: Path = ROOT) -> list[Path]:
    """The pages whose figure spans are rendered: README.md and docs/*.md but the generated docs/benchmarks.md."""
    return [root / "README.md", *sorted(p for p in (root / "docs").glob("*.md") if p.name != "benchmarks.md")]


LEGACY = {
    "bench_logprob.json": "rows of two runs merged by the removed --append option",
    "bench_loss_head.json": "rows of several runs merged by hand (meta.command is a list, `rows` holds superseded "
                            "rows); re-run `python benchmarks/kernels/bench_logprob.py --loss --full`",
}
"""Results files that do not reproduce from one command (kept until re-measured; see the section's note)."""

_CMD_ONLY = "Its command is recorded; the commit and the machine's load are not."
PRE_PROVENANCE: dict[str, str] = {
    **{name: _CMD_ONLY for name in (
        "bench_async.json", "bench_async_p2_curve_is_seed1.json", "bench_async_p2_curve_is_seed2.json",
        "bench_async_p2_curve_seed1.json", "bench_async_p2_curve_seed2.json", "bench_async_p2_idle.json",
        "bench_async_p2_len24.json", "bench_async_p2_len24_idle.json", "bench_async_p2_len96_idle.json",
        "bench_async_p2_stream.json", "bench_async_p4_stream.json", "bench_async_smollm2_p2.json",
        "bench_engines.json", "bench_engines_smollm2.json", "bench_reshard.json", "bench_scaling_grpo.json",
        "bench_transition.json", "e2e_grpo_vs_trl.json", "bench_sandbox.json",
        "validation_default_job.json", "validation_default_job_seed2.json", "validation_default_job_seed3.json",
        "verl_key_coverage.json", "bench_delta_sync.json", "bench_delta_sync_1000.json", "bench_lora_sync.json",
        "e2e_grpo_vs_trl_tiny_padded.json", "bench_moe_sync.json",
        "moe_layout_matrix.json")},
    "bench_across.json": "No command recorded; `python benchmarks/reshard/bench_across.py` (the quick model) is the "
                         "script's default run.",
    "bench_padding_free.json": "No command recorded; `args` holds the arguments it ran with.",
    "bench_rl.json": "No command recorded; meta.matrix says which matrix (`python benchmarks/kernels/bench_rl.py "
                     "--quick` or `--full`).",
    "bench_scaling.json": "No command recorded (the PPO job, `python benchmarks/scaling/bench_scaling.py`, steps "
                          "unknown).",
    "dataflow_overhead.json": "No command recorded; `mode` says which (`python benchmarks/dataflow/"
                              "bench_overhead.py --quick` or `--full`).",
    "megatron_layout_matrix.json": "No command recorded; `VERL_WRITE_RESULTS=1 python -m pytest -q "
                                   "tests/models/test_matrix.py` writes it.",
}
"""Results files written by one run of their benchmark before benchmarks recorded the commit and the machine's
load (verl.utils.results), with how they were made as far as the file says."""


# ---------------------------------------------------------------------------------------------- formatting

def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01 or a == 0:
            return f"{v:.3g}" if a < 1 else f"{v:.2f}"
        return f"{v:.2e}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict], columns: list[tuple[str, Callable[[dict], object] | str]]) -> list[str]:
    def cell(row, get):
        try:
            return fmt(row.get(get) if isinstance(get, str) else get(row))
        except (KeyError, TypeError, ZeroDivisionError):
            return ""
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r, g) for _, g in columns) + " |" for r in rows]
    return out


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested dicts one level into dotted keys; lists dropped (curves, samples)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def generic_rows(data: dict) -> list[dict]:
    for key in ("rows", "results", "cases", "chains"):
        rows = data.get(key)
        if isinstance(rows, dict):
            return [{"name": k, **flatten(v)} for k, v in rows.items()]
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            return [flatten(r) for r in rows]
    return [flatten({k: v for k, v in data.items() if k != "meta"})]


def generic(data: dict) -> list[str]:
    rows = generic_rows(data)
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("command", "run.command")))
    return table(rows, [(k, k) for k in keys])


def logprob(data: dict) -> list[str]:
    """Per size and variant: forward + backward time (thread CPU s) and peak extra memory."""
    rows = generic_rows(data)
    variants = [v for v in ("eager", "compiled", "fused_logits", "fused_linear", "loss_eager", "loss_compiled",
                            "loss_fused") if any(f"variants.{v}.fwd_bwd_peak_mib" in r for r in rows)]
    cols = [("N", "N"), ("H", "H"), ("V", "V")]
    for v in variants:
        cols += [(f"{v} s", f"variants.{v}.fwd_bwd_s"), (f"{v} MiB", f"variants.{v}.fwd_bwd_peak_mib")]
    ratio = "ratios" if any("ratios.time_fused_vs_eager" in r for r in rows) else "fused_linear_vs_eager"
    if ratio == "ratios":
        cols += [("time fused / eager", "ratios.time_fused_vs_eager"),
                 ("time fused / compiled", "ratios.time_fused_vs_compiled"),
                 ("memory fused / eager", "ratios.peak_mem_fused_vs_eager"), ("superseded", "superseded")]
    else:
        cols += [("time fused / eager", "fused_linear_vs_eager.fwd_bwd_s"),
                 ("memory fused / eager", "fused_linear_vs_eager.fwd_bwd_peak_mib")]
    return table(rows, cols)


def provenance(name: str, data: dict) -> list[str]:
    meta = data.get("meta") or data.get("config") or {}
    command = meta.get("command") or data.get("command")
    lines = []
    if isinstance(command, str):
        lines.append(f"Command: `{command}`")
    if meta.get("commit"):
        load = meta.get("load_avg_1m") or {}
        lines.append(f"Commit {meta['commit'][:10]}{' (with local changes)' if meta.get('dirty') else ''}, "
                     f"{meta.get('date_utc', '')}, {meta.get('cpus')} CPU cores"
                     f"{' (' + meta['cpu_model'] + ')' if meta.get('cpu_model') else ''}, load average "
                     f"{fmt(load.get('start'))} at the start and {fmt(load.get('end'))} at the end, "
                     f"{fmt(meta.get('wall_s'))} s.")
    else:
        lines.append("Written before the benchmarks recorded their commit and the machine's load.")
    if name in LEGACY:
        lines.append(f"Not reproducible from one command: {LEGACY[name]}.")
    if name in PRE_PROVENANCE:
        lines.append(PRE_PROVENANCE[name])
    return lines


# ---------------------------------------------------------------------------------------------- families

def last_mean(curve: list[float], k: int = 25) -> float:
    return statistics.mean(curve[-k:])


def quarter(curve: list[float], which: int) -> float:
    q = max(1, len(curve) // 4)
    return statistics.mean(curve[:q] if which == 0 else curve[-q:])


def async_table(data: dict) -> list[str]:
    rows = [r for r in data["rows"] if "error" not in r]
    note = []
    if any(r["mode"].endswith("_partial") and "switches" not in r for r in rows):
        note = ["", "Switches were not counted yet when this ran; its partial mode's token staleness equals its "
                    "staleness, so no response mixed weight versions: generation was much quicker than an update, "
                    "and each new version arrived while the rollout waited between batches (see "
                    "bench_async_p2_partial.json for a generation-bound job where switches happen)."]
    return note + [""] * bool(note) + table(rows, [("mode", "mode"), ("tokens/s", "tokens_per_s"), ("vs sync", "speedup_vs_sync"),
                        ("step s", "step_time_s"), ("idle rollout", "idle_share_rollout"),
                        ("idle actor", "idle_share_actor"), ("staleness", "staleness_mean"),
                        ("token staleness", "token_staleness_mean"), ("switches", "switches"),
                        ("mixed responses", "mixed_share"),
                        ("reward first quarter", lambda r: quarter(r["reward_curve"], 0)),
                        ("reward last quarter", lambda r: quarter(r["reward_curve"], -1)),
                        ("load", "load_avg_1min")])


def trl_kernels(data: dict) -> list[str]:
    s, r = data["summary"], data["ratios_verl_vs_trl"]
    keys = ("step_cpu_s", "update_cpu_s", "update_peak_mib", "peak_rss_mib", "step_wall_s")
    rows = [{"quantity": k, "verl": s["verl"][k], "trl": s["trl"][k], "verl / trl": r[k]} for k in keys]
    return table(rows, [(h, h) for h in ("quantity", "verl", "trl", "verl / trl")])


def e2e(data: dict) -> list[str]:
    rows = [{"side": side, **{k: v for k, v in data[side].items() if not isinstance(v, (list, dict))}}
            for side in ("verl", "trl")]
    lines = table(rows, [("side", "side"), ("s/step", "s_per_step"), ("tokens/s", "tokens_per_s"),
                         ("tokens/CPU-s", "tokens_per_cpu_s"), ("mean response", "mean_response_length"),
                         ("steps timed", "steps_timed")])
    lines += ["", f"Ratio (tokens/s, median): {fmt(data['ratio_tokens_per_s'])}x; best step vs best step "
                  f"{fmt(data['ratio_tokens_per_s_best'])}x"
                  + (f"; per CPU second {fmt(data['ratio_tokens_per_cpu_s'])}x" if "ratio_tokens_per_cpu_s" in data
                     else "") + "."]
    floor = data.get("compute_floor", {})
    if "floor_update_s" in floor:  # per phase: seconds, the floor's seconds, and the share of it
        phases = [{"side": side, "phase": phase, "s/step": data[side]["split"].get(f"{phase}_s"),
                   "floor s": floor.get(f"floor_{phase}_s"),
                   "share of the floor": data[side]["split"].get(f"floor_share_{phase}"),
                   "padded share": data[side]["split"].get(f"padded_share_{phase}")}
                  for side in ("verl", "trl") for phase in ("generate", "log_prob", "update", "sync")]
        lines += [""] + table(phases, [(k, k) for k in phases[0]])
    return lines


def train_job(data: dict) -> list[str]:
    meta = data["meta"]
    rows = [{"config": meta.get("config"), "overrides": " ".join(meta.get("overrides") or []) or "-",
             "steps": data["steps"], "job wall s": data["job_wall_s"], "job CPU s": data.get("job_cpu_s"),
             "step s (median)": data.get("step_time_s_median"), "step CPU s (median)": data.get("cpu_time_s_median"),
             f"reward, first {data['window']} steps": data["reward_first"],
             f"reward, last {data['window']} steps": data["reward_last"]}]
    lines = table(rows, [(k, k) for k in rows[0]])
    steps = [{"step": i + 1, "s": s, "CPU s": c, "generate s": g, "update s": u}
             for i, (s, c, g, u) in enumerate(zip(data["step_time_s"], data["cpu_time_s"] or [None] * 99,
                                                  data["generate_s"] or [None] * 99,
                                                  data["update_actor_s"] or [None] * 99))]
    if len(steps) <= 5:
        lines += [""] + table(steps, [(k, k) for k in steps[0]])
    return lines


def curves(results: dict) -> list[str]:
    """The learning comparison of the async modes: mean reward of the last 25 of 100 steps per run."""
    rows = []
    for name in sorted(results):
        if not name.startswith("bench_async_p2_curve"):
            continue
        modes = {r["mode"]: last_mean(r["reward_curve"]) for r in results[name]["rows"] if "error" not in r}
        rows.append({"run": name.removeprefix("bench_async_p2_curve_").removesuffix(".json"), **modes})
    cols = [("run", "run")] + [(m, m) for m in ("sync", "one_step_off", "async_s1", "async_s2")]
    trailed = sum(1 for r in rows if r["async_s2"] < r["sync"])
    return table(rows, cols) + ["", f"max_staleness=2 (async_s2) ended below sync in {trailed} of {len(rows)} runs."]


FAMILIES: list[tuple[str, str, Callable[[dict], list[str]]]] = [
    ("Training jobs (`verl train`, timed whole)", "train_", train_job),
    ("Asynchronous modes (`verl bench async`)", "bench_async", async_table),
    ("verl's kernels inside TRL", "bench_trl_kernels", trl_kernels),
    ("GRPO end to end: verl vs TRL", "e2e_grpo_vs_trl", e2e),
    ("Kernels", "bench_rl", generic), ("Kernels", "bench_logprob", logprob), ("Kernels", "bench_loss_head", logprob),
    ("Generation engines", "bench_engines", generic), ("Generation engines", "bench_padding_free", generic),
    ("Generation engines", "bench_prefix_tree", generic), ("Generation engines", "bench_cores", generic),
    ("Generation engines", "bench_quant", generic), ("Generation engines", "bench_continuous", generic),
    ("Generation engines", "bench_decode", generic), ("GRPO end to end: verl vs TRL", "bench_vs_commit", generic),
    ("3D-HybridEngine", "bench_reshard", generic), ("3D-HybridEngine", "bench_transition", generic),
    ("3D-HybridEngine", "bench_across", generic),
    ("Scaling", "bench_scaling", generic), ("Dataflow", "dataflow_overhead", generic),
    ("Megatron layouts", "megatron_layout_matrix", generic), ("Sandbox", "bench_sandbox", generic),
    ("Validation on held-out prompts", "validation_", generic),
    ("Weight sync: deltas and LoRA adapters", "bench_delta_sync", generic),
    ("Weight sync: deltas and LoRA adapters", "bench_lora_sync", generic),
    ("LoRA vs full fine-tuning", "bench_lora_vs_full", generic),
    ("Recovery under faults (`verl bench faults`)", "bench_faults", lambda d: faults(d)),  # defined below
    ("Upstream verl's config keys", "verl_key_coverage", generic),
]


def load(results_dir: Path = RESULTS) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


def family(name: str) -> tuple[str, Callable] | None:
    for title, prefix, fn in FAMILIES:
        if name.startswith(prefix):
            return title, fn
    return None


def render_doc(results: dict[str, dict]) -> str:
    lines = ["# Benchmark results", "",
             "Rendered by `python scripts/render_results.py` from `benchmarks/results/*.json`; do not edit by hand "
             "(`tests/test_docs_rendered.py` fails when this page differs from what the script renders). Each "
             "table gives the command that reproduces it, the commit it ran at and the machine's load: the "
             "machines these ran on are shared, so times compare within one run (side by side), not across runs.",
             "",
             "`verl bench kernels|dataflow|reshard|engines|e2e|scaling|async|compat` runs a suite (each script also "
             "runs alone, `--quick` by default, `--full` for the whole matrix); results are JSON and PNG under "
             "`benchmarks/results/`, always side by side with the baseline in one run (eager and `torch.compile` "
             "references, naive all-gather, the old full-gather weight transfer in `reshard/bench_transition.py`, "
             "the weight sync to a rollout on the actor's ranks against one on its own ranks in "
             "`reshard/bench_across.py`, TRL's GRPOTrainer). `verl bench engines` is the seed article's engine "
             "experiment: the same prompts through torch, vLLM and SGLang (+ transformers' generate), changing only "
             "`rollout.engine`: time, tokens/s, peak memory and token agreement with torch, or a row saying why an "
             "engine cannot run.",
             ""]
    titles: dict[str, list[str]] = {}
    traces = []
    for name, data in results.items():
        if "traceEvents" in data:
            traces.append(name)
            continue
        fam = family(name)
        title, fn = fam if fam is not None else ("Other results", generic)
        body = [f"### {name}", "", *provenance(name, data), "", *fn(data), ""]
        titles.setdefault(title, []).extend(body)
        if name == "bench_async_p2_curve_seed2.json":
            titles[title] += ["### Learning with stale weights (mean reward of the last 25 of 100 steps)", "",
                              *curves(results), ""]
    order = list(dict.fromkeys([t for t, _, _ in FAMILIES] + ["Other results"]))
    for title in sorted(titles, key=order.index):
        lines += [f"## {title}", "", *titles[title]]
    lines += ["## Traces", "", "Chrome trace-event files (open in Perfetto or chrome://tracing):", ""]
    lines += [f"- `benchmarks/results/{t}`" for t in traces]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- page figures

def _r(results, name):
    return results[name]


def fig_default_job(res) -> str:
    d = _r(res, "train_default_job.json")
    load = d["meta"]["load_avg_1m"]
    cpu = f" ({d['job_cpu_s']:.0f} s of CPU time)" if "job_cpu_s" in d else ""
    return (f"measured on {d['meta']['cpus']} CPU cores under a load average of {fmt(load['start'])}-"
            f"{fmt(load['end'])} from other jobs: mean reward {d['reward_first']:.2f} over the first {d['window']} "
            f"GRPO steps → {d['reward_last']:.2f} over the last {d['window']}, in {d['job_wall_s']:.0f} s{cpu}")


def fig_smollm2_step(res) -> str:
    d = _r(res, "train_smollm2_gsm8k.json")
    load = d["meta"]["load_avg_1m"]
    def both(xs):
        return " and ".join(f"{x:.0f}" for x in xs)
    return (f"the first {d['steps']} steps took {both(d['step_time_s'])} s (generation {both(d['generate_s'])} s of "
            f"them; {both(d['cpu_time_s'])} CPU-s) under a load average of {fmt(load['start'])}-{fmt(load['end'])} "
            f"from other jobs")


def fig_stale_trailed(res) -> str:
    return curves(res)[-1].removeprefix("max_staleness=2 (async_s2) ended below sync in ").removesuffix(" runs.")


def fig_curves(res) -> str:
    def pair(mode, kind):
        vals = [last_mean(r["reward_curve"]) for s in ("seed1", "seed2")
                for r in res[f"bench_async_p2_curve_{kind}{s}.json"]["rows"] if r["mode"] == mode]
        return " / ".join(f"{v:.3f}" for v in vals)
    return (f"sync reached {pair('sync', 'is_')}, async max_staleness=1 {pair('async_s1', 'is_')} and "
            f"max_staleness=2 {pair('async_s2', 'is_')}; without the correction {pair('sync', '')}, "
            f"{pair('async_s1', '')} and {pair('async_s2', '')}")


def _modes(res, name):
    return {r["mode"]: r for r in res[name]["rows"] if "error" not in r}


def fig_async_p2(res) -> str:
    m = _modes(res, "bench_async_p2_stream.json")
    return (f"one_step_off {m['one_step_off']['speedup_vs_sync']:.2f}x sync, async with max_staleness=1 "
            f"{m['async_s1']['speedup_vs_sync']:.2f}x (the same samples and rewards as one_step_off, the lockstep "
            f"meeting gone), the actor's idle share falling from {100 * m['sync']['idle_share_actor']:.0f}% to "
            f"{100 * m['async_s1']['idle_share_actor']:.0f}%. max_staleness=2 gave "
            f"{m['async_s2']['speedup_vs_sync']:.2f}x: its staler updates made longer responses (the actor, "
            f"{100 * (1 - m['async_s2']['idle_share_actor']):.0f}% busy, is the bottleneck)")


def fig_async_smollm2(res) -> str:
    m = _modes(res, "bench_async_smollm2_p2.json")
    idle = max(m[k][s] for k in ("one_step_off", "async_s1") for s in ("idle_share_rollout", "idle_share_actor"))
    return (f"one_step_off ran at {m['one_step_off']['speedup_vs_sync']:.2f}x sync and async (max_staleness=1) at "
            f"{m['async_s1']['speedup_vs_sync']:.2f}x, each side idle at most {100 * idle:.1f}% of the time "
            f"({100 * m['sync']['idle_share_rollout']:.0f}% and "
            f"{100 * m['sync']['idle_share_actor']:.0f}% in sync); partial rollouts cost there "
            f"({m['async_s2_partial']['speedup_vs_sync']:.2f}x with max_staleness=2")


def fig_async_p4(res) -> str:
    m = _modes(res, "bench_async_p4_stream.json")
    ratios = [r["speedup_vs_sync"] for k, r in m.items() if k != "sync"]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def fig_trl_kernels(res) -> str:
    d = res["bench_trl_kernels.json"]
    s, r = d["summary"], d["ratios_verl_vs_trl"]
    v, t = s["verl"], s["trl"]
    return (f"medians of {v['steps_measured']} steps): the loss forward + backward takes {r['update_cpu_s']:.2f}x TRL's CPU time ({v['update_cpu_s']:.2f} s vs "
            f"{t['update_cpu_s']:.2f} s) and {r['update_peak_mib']:.2f}x its peak memory ({v['update_peak_mib']:.0f} vs "
            f"{t['update_peak_mib']:.0f} MiB above the resident set); a whole step (generation and reference log-probs "
            f"included) {r['step_cpu_s']:.2f}x the CPU time, and the process peaks at {r['peak_rss_mib']:.2f}x "
            f"({v['peak_rss_mib']:.0f} vs {t['peak_rss_mib']:.0f} MiB)")


def fig_stream_trace(res) -> str:
    """From the Chrome trace of one async step: when each rank set ran its nodes, and with which weights."""
    nodes = [e for e in res["async_stream_trace.json"]["traceEvents"] if e.get("cat") == "node"]
    t0 = min(e["ts"] for e in nodes)
    gen = next(e for e in nodes if e["name"] == "generate")
    train = [e for e in nodes if e["pid"] != gen["pid"]]
    upd = next(e for e in train if e["name"] == "update_actor")
    start, end = (min(e["ts"] for e in train) - t0) / 1e3, (max(e["ts"] + e["dur"] for e in train) - t0) / 1e3
    return (f"rank {gen['pid']} generates batch 10 with weight version "
            f"{gen['args']['outputs']['batch']['weight_version'][0]} from {(gen['ts'] - t0) / 1e3:.0f} to "
            f"{(gen['ts'] + gen['dur'] - t0) / 1e3:.0f} ms while rank {upd['pid']} trains on batch 9 (version "
            f"{upd['args']['inputs']['batch']['weight_version'][0]}) from {start:.0f} to {end:.0f} ms")


def fig_tito(res) -> str:
    rows = res["bench_tito.json"]["rows"]
    return "\n" + "\n".join(table(rows, [
        ("template", "template"), ("append-only", "append_only"), ("conversations", "conversations"),
        ("turns", "turns"), ("equal", "equal"), ("caught (planted non-canonical splits)", "noncanonical_caught"),
        ("missed", "noncanonical_missed"), ("rewritten (non-append-only rule)", "rewritten"), ("silent", "silent"),
        ("trained but not sampled", "untrained_sampled"), ("check ms/turn (mean)", "check_ms_per_turn_mean"),
        ("check ms/turn (median)", "check_ms_per_turn_p50")])) + "\n"


def fig_agent_bench(res, name: str = "bench_agent.json") -> str:
    d = res[name]
    rows = {(r["schedule"], r["latency_s"]): r for r in d["rows"]}
    lat = sorted({k[1] for k in rows})
    cells = [{"latency": f"{1e3 * x:.0f} ms", "loop": rows[("agent_loop", x)], "lock": rows[("lockstep", x)]}
             for x in lat]
    meta = d["meta"]
    head = (f"\n{meta['trajectories']} trajectories x {meta['turns']} turns of {meta['turn_tokens']} tokens, "
            f"median of {meta['rounds']} rounds, {meta['cpus']} CPU cores shared with other jobs:\n\n")
    return head + "\n".join(table(cells, [
        ("tool latency", "latency"), ("agent loop step s", lambda c: c["loop"]["step_s"]),
        ("agent loop tokens/s", lambda c: c["loop"]["tokens_per_s"]),
        ("vs its 0-latency step", lambda c: c["loop"]["step_vs_first_latency"]),
        ("lockstep step s", lambda c: c["lock"]["step_s"]), ("lockstep tokens/s", lambda c: c["lock"]["tokens_per_s"]),
        ("agent loop vs lockstep", lambda c: c["loop"]["speedup_vs_lockstep"]),
        ("tool path s (no step is shorter)", lambda c: c["loop"].get("tool_path_s", ""))])) + "\n"


def fig_agent_bench_exp(res) -> str:
    return fig_agent_bench(res, "bench_agent_exp.json")


def _first_last(d: dict, key: str) -> str:
    v = d.get(key)
    return "" if not v else f"{v['first']:.2f} → {v['last']:.2f}"


def fig_agent_job(res) -> str:
    d = res["train_agent_arithmetic.json"]
    load = d["meta"]["load_avg_1m"]
    return (f"over {d['steps']} GRPO steps the mean reward went {d['reward_first']:.2f} → {d['reward_last']:.2f} and "
            f"the tool-use rate {_first_last(d, 'rollout/tool_use_rate')} (means of the first and last "
            f"{d['window']} steps), turns per trajectory {_first_last(d, 'rollout/turns_mean')}; the whole job, warm "
            f"start included, took {d['job_wall_s']:.0f} s on {d['meta']['cpus']} CPU cores (load average "
            f"{fmt(load['start'])}-{fmt(load['end'])}); the append-only check's rollout/tito_mismatch was at most "
            f"{max(d['rollout/tito_mismatch']['curve']):g} in any step; command `{d['meta']['command']}`")


def fig_agent_trace(res) -> str:
    """From the Chrome trace of one agent step: the tool calls run while other trajectories generate."""
    ev = [e for e in res["train_agent_arithmetic_trace.json"]["traceEvents"] if e.get("ph") == "X"]
    node = next(e for e in ev if e.get("cat") == "node" and e["name"] == "generate")
    gen = [e for e in ev if e.get("cat") == "agent" and e["name"] == "generate"]
    tools = [e for e in ev if e.get("cat") == "agent" and e["name"].startswith("tools")]
    overlapping = sum(any(g["tid"] != t["tid"] and g["ts"] < t["ts"] + t["dur"] and g["ts"] + g["dur"] > t["ts"]
                          for g in gen) for t in tools)
    t0 = node["ts"]
    return (f"the step's generate node lasts {node['dur'] / 1e3:.0f} ms; its {len({e['tid'] for e in gen})} "
            f"trajectories each have a track with their turns (`generate`), environment steps and "
            f"{len(tools)} calculator calls, from {min(t['ts'] - t0 for t in tools) / 1e3:.0f} ms on; "
            f"{overlapping} of the {len(tools)} tool calls run while another trajectory's turn is being generated")


def fig_moe_jobs(res) -> str:
    parts = []
    for name in ("train_moe_tiny.json", "train_moe_tiny_ep2.json"):
        d = res[name]
        parts.append(f"{d['processes']} process{'es' if d['processes'] > 1 else ''} (`{d['meta']['command']}`): "
                     f"mean reward {d['reward_first']:.2f} over the first {d['window']} GRPO steps → "
                     f"{d['reward_last']:.2f} over the last {d['window']} of {d['steps']}, in {d['job_wall_s']:.0f} s, "
                     f"moe/router_mismatch_frac at most "
                     f"{max(d['moe/router_mismatch_frac']['curve']):g} (replay on)")
    return "; ".join(parts)


def fig_router_replay(res) -> str:
    runs = res["bench_router_replay.json"]["runs"]
    cols = [("run", "name"), ("router mismatch (mean)", "moe/router_mismatch_frac"),
            ("router mismatch (max)", "moe/router_mismatch_frac_max"),
            ("log-prob mismatch (mean)", "rollout/mismatch_mean"), ("mismatch KL", "rollout/mismatch_kl"),
            ("expert load max/mean", "moe/expert_load_max_over_mean"), ("reward first", "reward_first"),
            ("reward last", "reward_last")]
    return "\n" + "\n".join(table([{"name": k, **v} for k, v in runs.items()], cols)) + "\n"


def _mb(b) -> str:
    return f"{b / 1e6:,.1f} MB"


def fig_lora_sync(res) -> str:
    d = res["bench_lora_sync.json"]["summary"]
    f, lo, r = d["full"], d["lora"], d["ratios"]
    rows = [("bytes handed to the engine", _mb(f["bytes"]),
             f"{_mb(lo['bytes'])} ({r['lora_bytes_over_adapter']:.2f}x the adapter; "
             f"{100 * r['adapter_over_model']:.2f}% of the model)"),
            ("time", f"{f['sync_s']:.3f} s", f"{lo['sync_s']:.3f} s ({r['lora_time_over_full']:.2f}x)"),
            ("engine swap", f"{1e3 * f['swap_s']:.1f} ms", f"{1e3 * lo['swap_s']:.2f} ms"),
            ("bytes written by the process during the sync", f"{f['disk_write_bytes']:.0f}",
             f"{lo['disk_write_bytes']:.0f}")]
    return "\n" + "\n".join(table([dict(zip(("what", "full", "lora"), row)) for row in rows],
                                  [("", "what"), ("full fine-tune sync", "full"), ("LoRA adapter sync", "lora")])) + "\n"


def fig_lora_memory(res) -> str:
    m = res["bench_lora_sync.json"]["memory"]
    rows = [{"who": "full fine-tune (frozen copy as reference)", "w": f"{m['full']['weights_x_model']:.2f}x one model",
             "o": f"{m['full']['with_optimizer_x_model']:.2f}x"},
            {"who": "LoRA (base with adapters off)", "w": f"{m['lora']['weights_x_model']:.3f}x",
             "o": f"{m['lora']['with_optimizer_x_model']:.3f}x"}]
    return "\n" + "\n".join(table(rows, [("actor + reference", "who"), ("weights", "w"),
                                           ("weights + AdamW state", "o")])) + "\n"


def fig_lora_vs_full(res) -> str:
    d = res["bench_lora_vs_full.json"]
    s, load = d["summary"], d["meta"].get("load_avg_1m")
    rows = [("tokens/s, median over steps", f"{s['tokens_per_s_ratio_median']:.2f}x"),
            ("tokens/s, all tokens over all time", f"{s['tokens_per_s_ratio_total']:.2f}x"),
            ("update time, median", f"{s['update_time_ratio_median']:.2f}x"),
            ("generation time, median", f"{s['generate_time_ratio_median']:.2f}x"),
            ("tokens per CPU second of the job's process, median", f"{s['tokens_per_cpu_s_ratio_median']:.2f}x"),
            ("the full job's step with a third of its update gone (skipping every weight gradient), median",
             f"{s['ceiling_ratio_median']:.2f}x"),
            ("reward first / last / mean of the last half, LoRA",
             f"{s['reward_first']['lora']:.4f} / {s['reward_last']['lora']:.4f} / "
             f"{s['reward_mean_last_half']['lora']:.4f}"),
            ("reward first / last / mean of the last half, full",
             f"{s['reward_first']['full']:.4f} / {s['reward_last']['full']:.4f} / "
             f"{s['reward_mean_last_half']['full']:.4f}")]
    note = "" if not load else f" (machine load {fmt(load['start'])}-{fmt(load['end'])})"
    return "\n" + "\n".join(table([{"k": a, "v": b} for a, b in rows], [("", "k"), ("LoRA / full" + note, "v")])) + "\n"


_DELTA_NAMES = {"megatron": "megatron", "fsdp": "FSDP2", "torch": "torch replicas"}


def _delta_rows(d: dict) -> list[dict]:
    out = []
    for src, r in d["results"].items():
        m = r["summary"]
        out.append({"source": f"{_DELTA_NAMES.get(src, src)}, {r['processes']} processes", "syncs": m["syncs"],
                    "exact": m["bit_exact_after_all"],
                    "changed": f"{100 * m['changed_frac_min']:.2f}-{100 * m['changed_frac_max']:.2f}% "
                               f"(median {100 * m['changed_frac_median']:.2f}%)",
                    "bytes": f"{_mb(m['bytes_median'])} of {_mb(m['full_bytes'])} ({100 * m['bytes_ratio']:.1f}%)",
                    "wire": f"{_mb(m['comm_bytes_median'])} / {_mb(m['full_comm_bytes'])}",
                    "time": f"{m['sync_s_median']:.2f} s / {m['full_s_median']:.2f} s ({m['time_ratio']:.2f}x)"})
    return out


def _delta_table(name: str, res) -> str:
    return "\n" + "\n".join(table(_delta_rows(res[name]), [
        ("source", "source"), ("syncs", "syncs"), ("bit-exact at the end", "exact"),
        ("changed share", "changed"), ("bytes to the engine (of full)", "bytes"),
        ("bytes on the wire: delta / full", "wire"), ("time: delta / full (median)", "time")])) + "\n"


def fig_delta_sync(res) -> str:
    return _delta_table("bench_delta_sync.json", res)


def fig_delta_1000(res) -> str:
    return _delta_table("bench_delta_sync_1000.json", res)


def fig_moe_dispatch(res) -> str:
    rows = res["bench_moe_dispatch.json"]["rows"]
    return "\n" + "\n".join(table(rows, [
        ("allocator", "allocator"), ("tokens x hidden x experts (top-2)",
                                     lambda r: f"{r['tokens']} x {r['hidden']} x {r['experts']}"),
        ("verl s", lambda r: r["seconds"]["verl"]), ("megatron-core s", lambda r: r["seconds"]["megatron"]),
        ("eager s", lambda r: r["seconds"]["eager"]), ("vs eager", "speedup_vs_eager"),
        ("vs megatron-core", "speedup_vs_megatron"), ("memory vs eager", "memory_vs_eager"),
        ("memory vs megatron-core", "memory_vs_megatron")])) + "\n"


def fig_moe_sync(res) -> str:
    r = res["bench_moe_sync.json"]["rows"][0]
    got = max(r["hybrid_received_bytes_per_rank"])
    return (f"EP={r['ep']} on {r['processes']} processes → generation TP={r['rollout_tp']} "
            f"({r['params'] / 1e6:.1f}M parameters): the 3D-HybridEngine sync took {1e3 * r['hybrid_s']:.0f} ms, "
            f"{100 * r['hybrid_over_full_gather']:.0f}% of a full gather ({1e3 * r['full_gather_s']:.0f} ms); each "
            f"rank received {got / 2**20:.1f} MiB of the {r['engine_bytes'] / 2**20:.1f} MiB model (the experts it "
            f"lacks), and generation was identical: {fmt(r['same_generation'])}")


def fig_moe_layout(res) -> str:
    cases = res["moe_layout_matrix.json"]["cases"]
    fams = sorted({c["architecture"] for c in cases})
    return (f"{len(cases)} cases ({', '.join(fams)}; EP=2, TP=2 with SP and ETP=2 or EP=2, PP=2, one rank): largest "
            f"|Δ logit| {max(c['max_logit_diff'] for c in cases):.1e}, |Δ log-prob| "
            f"{max(c['max_logprob_diff'] for c in cases):.1e}, |Δ gradient| "
            f"{max(c['max_grad_diff'] for c in cases):.1e} against transformers in float32; export bit-exact in "
            f"{sum(bool(c['export_bit_exact']) for c in cases)} of {len(cases)}")


def _faults_table(d: dict) -> str:
    meta = d["meta"]
    failed = [r for r in d["rows"] if r.get("rc") != 0]
    pairs = max((r.get("pairs", 1) for r in d.get("summary", [])), default=1)
    how = (f"{pairs} pairs of an uninterrupted run and a faulty one per mode; goodput: the uninterrupted runs' "
           f"wall time over the faulty runs', pooled (each pair's in parentheses); indices summed over the runs"
           if pairs > 1 else "goodput: the uninterrupted run's wall time over the faulty run's")
    how += "; in recovery: the faulty runs' wall time from each kill to the next step done"
    return (f"\n`{meta['command']}` ({meta['job']}, {meta['steps']} steps, a kill every ~{meta['fault_every_s']:g} s; "
            f"{how}; isolated: kills whose recovery ended before the next kill)\n\n" + "\n".join(faults(d))
            + (f"\n\n{len(failed)} run(s) did not finish" if failed else "") + "\n")


def faults(d: dict) -> list[str]:
    """bench_faults*.json: one row per mode (older files without `summary`: one per faulty run)."""
    def s(v):
        return "-" if v is None else f"{v:.2f}"

    def split(r):
        p = r.get("split_s_median") or {}
        return " / ".join(s(p.get(k)) for k in ("agent_restart", "start", "restore", "first_step"))
    rows = [r for r in d.get("summary", d["rows"]) if r.get("rc") == 0]

    def goodput(r):
        each = r.get("goodput_runs", [])
        return f"{100 * r['goodput']:.0f}%" + (f" ({', '.join(f'{100 * g:.0f}%' for g in each)})" if len(each) > 1
                                               else "")

    def runs_of(r):
        return [x for x in d["rows"] if x["mode"] == r["mode"] and x.get("rc") == 0] if "summary" in d else [r]

    def clean_walls(r):  # the machine's drift: the same job uninterrupted, run to run
        return ", ".join(f"{x['uninterrupted']['wall_s']:.0f}" for x in runs_of(r))

    def in_recovery(r):  # measured inside the faulty runs, so the drift between runs does not enter
        runs = runs_of(r)
        spent = sum(f.get("recovery_s", 0.0) for x in runs for f in x["faults"])
        return f"{100 * spent / sum(x['wall_s'] for x in runs):.1f}%"
    lines = table(rows, [
        ("mode", "mode"), ("kills (isolated)", lambda r: f"{r['kills']} ({r['isolated_faults']})"),
        ("goodput", goodput), ("uninterrupted runs, s", clean_walls), ("in recovery", in_recovery),
        ("recovery s, median / max", lambda r: f"{s(r['recovery_s_median'])} / {s(r['recovery_s_max'])}"),
        ("split s: agent restart / start / restore / first step", split),
        ("steps redone, max", "redone_steps_max"),
        ("snapshot / step", lambda r: f"{100 * r['uninterrupted']['snapshot_share']:.1f}%"
         if r["uninterrupted"].get("snapshot_share") is not None else "-"),
        ("weights bit-equal", "weights_equal"),
        ("metrics equal", lambda r: "yes" if r["metrics_equal"] else "no: step {step}, {keys}".format(
            step=r["metrics_first_difference"]["step"],
            keys=", ".join(r["metrics_first_difference"]["values"])) if r.get("metrics_first_difference") else "no"),
        ("indices trained / twice / skipped", lambda r: "{indices_trained} / {duplicates} / {skipped}".format(
            **r["exactly_once"])),
        ("2 uninterrupted runs equal", lambda r: r.get("uninterrupted_twice_weights_equal", "-"))])
    return lines


def fig_faults(res) -> str:
    return _faults_table(res["bench_faults.json"])


def fig_faults_exact(res) -> str:
    return _faults_table(res["bench_faults_exact.json"])


def fig_faults_async_exact(res) -> str:
    return _faults_table(res["bench_faults_async_exact.json"])


def fig_snapshot_smollm2(res) -> str:
    r = res["bench_snapshot.json"]["rows"][0]
    share = r.get("copy_share_of_step")
    return (f"{r['model']} in float32 with its AdamW state ({r['state_bytes'] / 2**30:.2f} GiB): the copy on the "
            f"critical path took {r['copy_s_median']:.2f} s, the background write {r['write_s_median']:.2f} s and a "
            f"restore {r['restore_s_median']:.2f} s (medians of {len(r['copy_s'])}); "
            + (f"the example's step took {r['example_step_s']:.0f} s on this machine (`{r['example_step_from']}`), "
               f"so the copy is {100 * share:.2f}% of a step" if share is not None else "no step time on record"))


def fig_quant(res) -> str:
    d = res["bench_quant.json"]
    g, c = d["generate"], d["curves"]
    job = g["job"]
    kl = {q: g[q]["mismatch"]["rollout/mismatch_kl"] for q in ("fp32", "int8")}
    fp, q8 = c["final_reward_fp32"], c["final_reward_int8"]
    return (f"on SmolLM2-135M ({job['prompts']} prompts x {job['n']} samples x {job['max_new_tokens']} tokens, "
            f"EOS ignored so both sides decode the same tokens, one thread, alternating runs) int8 generated "
            f"{g['int8']['tokens_per_s']:.1f} tokens/s against float32's {g['fp32']['tokens_per_s']:.1f} "
            f"(**{g['speedup_tokens_per_s']:.2f}x**), with rollout/mismatch_kl {kl['int8']:.1e} against the float32 "
            f"model's forward (float32's own: {kl['fp32']:.0e}); over {len(c['runs'][0]['curve']['reward/mean'])} "
            f"steps of the default job the final reward (last 10 steps) was "
            f"{', '.join(f'{v:.3f}' for v in q8)} with int8 and {', '.join(f'{v:.3f}' for v in fp)} with float32 "
            f"(seeds {', '.join(str(r['seed']) for r in c['runs'] if r['quantization'] == 'none')}): a gap of "
            f"{c['int8_gap']:.3f} against a seed-to-seed spread of {c['fp32_seed_spread']:.3f} "
            f"({'within' if c['within_spread'] else 'outside'} it)")


def fig_quant_job(res) -> str:
    meta, d = res["bench_quant_job.json"]["meta"], res["bench_quant_job.json"]["job"]
    r = d["runs"]

    def phase(q, key):
        steps = r[q]["steps"]
        return sum(s[key] or 0.0 for s in steps) / len(steps)

    return (f"the example job itself ({len(r['none']['steps'])} steps per side, `{meta['command']}`): "
            f"generation {r['int8']['generate_tokens_per_s']:.1f} tokens/s with int8 against "
            f"{r['none']['generate_tokens_per_s']:.1f} (**{d['generate_tokens_per_s_ratio']:.2f}x**); a step took "
            f"{r['int8']['step_s_mean']:.0f} s against {r['none']['step_s_mean']:.0f} s (generation "
            f"{phase('int8', 'timing/generate_s'):.0f} vs {phase('none', 'timing/generate_s'):.0f} s, old log-probs "
            f"{phase('int8', 'timing/old_log_prob_s'):.0f} vs {phase('none', 'timing/old_log_prob_s'):.0f} s; update "
            f"{phase('int8', 'timing/update_actor_s'):.0f} vs {phase('none', 'timing/update_actor_s'):.0f} s; mean "
            f"response length {phase('int8', 'response/length'):.0f} vs {phase('none', 'response/length'):.0f})")


def fig_prefix_tree(res) -> str:
    d = res["bench_prefix_tree.json"]
    f, t, p = d["forward_tokens"], d["tree"], d["packed"]
    wall = {k: sum(r["wall_s"] for r in v) / len(v) for k, v in (("tree", t), ("packed", p))}
    return (f"on real rollouts of the example at rollout.n={d['n']} ({d['responses']} responses, prompts "
            f"{d['prompt_tokens_mean']:.0f} and responses {d['response_tokens_mean']:.0f} tokens on average; "
            f"micro-batches of one group; `{d['meta']['command']}`) the update's forward computed "
            f"{f['tree_per_group']} tokens as prefix trees against {f['packed']} plainly packed "
            f"(**{d['token_ratio']:.2f}x fewer**; sharing each prompt alone bounds this at "
            f"{d['token_ratio_bound_prompt_only']:.2f}x at this shape) and took {wall['tree']:.0f} s against "
            f"{wall['packed']:.0f} s (**{d['update_speedup_wall']:.2f}x**, CPU time "
            f"{d['update_speedup_cpu']:.2f}x; {d['threads']} threads)" + _critic_tree(d))


def _critic_tree(d) -> str:
    c = d.get("critic")
    if c is None:
        return ""
    wall = {k: sum(r["wall_s"] for r in c[k]) / len(c[k]) for k in ("tree", "packed")}
    return (f"; the critic (`critic.share_prompt_prefix`, a value head on the same model; its value pass and "
            f"update) computed **{c['token_ratio']:.2f}x fewer** tokens and took {wall['tree']:.0f} s against "
            f"{wall['packed']:.0f} s (**{c['speedup_wall']:.2f}x**, CPU time {c['speedup_cpu']:.2f}x)")


def fig_cores(res) -> str:
    d = res["bench_cores.json"]
    phase = lambda r, k: r["phases_s"].get(f"timing/{k}_s", 0.0)  # noqa: E731
    sides = "; ".join(f"{r['side']}: {r['tokens_per_s']:.1f} trained tokens/s, {r['step_time_s']:.0f} s/step "
                      f"(**{r['vs_first']:.2f}x**; generation {phase(r, 'generate'):.0f} s, update "
                      f"{phase(r, 'update_actor'):.0f} s; load average after it "
                      f"{r['load_avg_1min_after']:.1f})" for r in d["sides"])
    return (f"{sides}, over {d['sides'][0]['steps_measured']} steps after the first of "
            f"`{d['meta']['command']}`")


def fig_continuous(res) -> str:
    d = res["bench_continuous.json"]
    m, (w, c) = d["meta"], d["rows"]
    lengths = m["response_length"]
    return (f"{m['prompts']} prompts x {m['n']} samples ({m['model']}, responses of {lengths['min']}..{lengths['max']} "
            f"tokens, mean {lengths['mean']:.0f}) with rollout.max_batch_size={m['max_batch_size']}: waves "
            f"{w['seconds']:.1f} s ({w['tokens_per_s']:.0f} tokens/s), continuous {c['seconds']:.1f} s "
            f"({c['tokens_per_s']:.0f} tokens/s, **{c['speedup']:.2f}x**, {c['joins']:.0f} joins); "
            f"{m['rows_same_tokens']} of {m['rows']} rows sampled the same tokens on both sides "
            f"(`{m['command']}`, median of {m['reps']})")


def fig_decode(res) -> str:
    d = res["bench_decode.json"]
    job = d["job"]

    def part(name, what):
        r = d[name]
        return (f"{what}: {r['now']['tokens_per_s']:.1f} tokens/s against {r['prev']['tokens_per_s']:.1f} with oneDNN's "
                f"projections and SDPA's attention (**{r['speedup_now_over_prev']:.2f}x**) and {r['filed']['tokens_per_s']:.1f} as filed "
                f"(**{r['speedup_now_over_filed']:.2f}x**), {r['now']['identical_to_filed']} of {r['samples']} "
                f"samples identical to the filed side's")
    parts = [part(n, w) for n, w in (("equal", f"EOS ignored ({job['max_new_tokens']} tokens per row on all sides)"),
                                     ("eos", "rows ending at EOS as in the example")) if n in d]
    if "steps" in d:
        st = d["steps"]
        parts.append(f"the decode step alone, the sides' calls alternating step by step ({st['decode_steps']} steps "
                     f"from a {st['prompt_width']}-token prompt): " + ", ".join(
                         f"{rows} rows **{r['now_over_filed']:.2f}x** filed and **{r['now_over_prev']:.2f}x** oneDNN + SDPA"
                         for rows, r in st["rows"].items()))
    return (f"{d['model']}, {job['prompts']} prompts x {job['n']} samples, one thread, alternating runs, packing "
            f"now {d['packing_now']} (`{d['meta']['command']}`, median of {job['repeats']}); " + "; ".join(parts))


def _example_change(d) -> str:
    """What differs in the example's settings between the two commits (its diff's lines, comments aside)."""
    if d["example_same_at_both"]:
        return "the example's settings the same at both"
    lines = [(ln[0], ln[1:].split("#")[0].strip()) for ln in d["example_diff"].splitlines()
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    old = [t for sign, t in lines if sign == "-" and t]
    new = [t for sign, t in lines if sign == "+" and t]
    old, new = [t for t in old if t not in new], [t for t in new if t not in old]  # comment-only edits drop out
    return f"the example's settings changed: {'; '.join(old)} -> {'; '.join(new)}"


def fig_vs_commit(d) -> str:
    b, n = d["baseline"], d["now"]

    def side(r):
        ph = r["phases_s"]
        return (f"{r['response_tokens_per_s']:.1f} generated tokens/s, {r['step_s']:.0f} s/step (generation "
                f"{ph['timing/generate_s']:.0f} s, update {ph['timing/update_actor_s']:.0f} s; mean response "
                f"{r['response_length']:.0f} tokens; {r['steps_counted']} steps counted)")
    rounds = d["rounds"]
    which = f"steps {', '.join(map(str, d['steps_paired']))}" + (f" of {rounds} rounds" if rounds > 1 else "")
    return (f"{which} at {b['commit'][:10]}: {side(b)}; the same steps at "
            f"{n['commit'][:10]}: {side(n)}; **{d['response_tokens_per_s_ratio']:.2f}x** the generated tokens/s "
            f"({d['tokens_per_s_ratio']:.2f}x the trained tokens/s; per step "
            f"{', '.join(f'{r:.2f}x' for r in d['step_ratios'])}), {_example_change(d)} (`{d['meta']['command']}`: "
            f"{d['schedule']})")


FIGURES: dict[str, Callable[[dict], str]] = {
    "continuous": fig_continuous, "decode": fig_decode,
    "vs_commit_sequential": lambda res: fig_vs_commit(res["bench_vs_commit_sequential.json"]),
    "quant": fig_quant, "quant_job": fig_quant_job, "prefix_tree": fig_prefix_tree, "cores": fig_cores,
    "faults": fig_faults, "faults_exact": fig_faults_exact, "faults_async_exact": fig_faults_async_exact,
    "snapshot_smollm2": fig_snapshot_smollm2,
    "tito": fig_tito, "agent_bench": fig_agent_bench, "agent_bench_exp": fig_agent_bench_exp, "agent_job": fig_agent_job, "agent_trace": fig_agent_trace, "moe_dispatch": fig_moe_dispatch, "moe_sync": fig_moe_sync,
    "lora_sync": fig_lora_sync, "lora_memory": fig_lora_memory, "lora_vs_full": fig_lora_vs_full,
    "delta_sync": fig_delta_sync, "delta_1000": fig_delta_1000,
    "moe_layout": fig_moe_layout, "moe_jobs": fig_moe_jobs, "router_replay": fig_router_replay,
    "stream_trace": fig_stream_trace,
    "default_job": fig_default_job, "smollm2_step": fig_smollm2_step, "stale_trailed": fig_stale_trailed,
    "async_curves": fig_curves, "async_p2": fig_async_p2, "async_smollm2": fig_async_smollm2,
    "async_p4": fig_async_p4, "trl_kernels": fig_trl_kernels,
}
SPAN = re.compile(r"<!-- fig:(\w+) -->(.*?)<!-- /fig -->", re.S)


def render_spans(text: str, results: dict[str, dict], page: str = "README.md") -> str:
    """`text` with each figure span's text rendered from `results`; `page` names the file in the error."""
    def sub(m):
        name = m.group(1)
        if name not in FIGURES:
            raise KeyError(f"{page} quotes figure {name!r}, which scripts/render_results.py does not render")
        return f"<!-- fig:{name} -->{FIGURES[name](results)}<!-- /fig -->"
    return SPAN.sub(sub, text)


def quoted_figures(pages: list[Path]) -> set[str]:
    return {name for p in pages for name, _ in SPAN.findall(p.read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = ap.parse_args(argv)
    results = load()
    pages = figure_pages()
    unquoted = set(FIGURES) - quoted_figures(pages)
    if unquoted:
        print(f"no page quotes the figures {sorted(unquoted)}: add a span or remove them from FIGURES",
              file=sys.stderr)
        return 1
    wanted = {DOC: render_doc(results)}
    wanted.update({p: render_spans(p.read_text(), results, str(p.relative_to(ROOT))) for p in pages})
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from what scripts/render_results.py renders; run it",
                  file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
