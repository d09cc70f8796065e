"""Asynchronous RL on the default job: sync vs one_step_off vs async (max_staleness 1 and 2), side by side.

Every run is `verl train` under torchrun on 4 CPU processes with split placement: the actor (with its
reference and the rule reward) on ranks 0-1, the rollout on ranks 2-3, weights sent across by the
3D-HybridEngine (at each step boundary in sync / one_step_off, streamed in the background in async). Only
`trainer.mode` / `algorithm.max_staleness` / `rollout.partial` change between runs, and the modes are
interleaved round by round (--rounds), so the machine's state is shared alike.

Reported per mode, over the steps after the first (which pays for start-up and the prologue): tokens/s (the
trained tokens of those steps over the wall-clock time they took, so runs that overlap differently are
compared on equal work) and its ratio to sync, step time, the idle share of each rank set (time outside its
own nodes: waiting for data, for weights, or for room in the queue), the mean staleness of the trained samples,
and the reward of the first and last steps, so that a speedup is not bought with learning. With
rollout.partial, also how often a new weight version reached the rollout mid-generation: `switches` (the torch
engine's KV-cache rebuilds for a new version, rollout/partial_rebuilds, summed over the measured steps) and
`mixed_share` (the share of trained responses whose tokens came from two versions). On a job whose generation is
much quicker than an update (the default job: short EOS-ended answers) there are none: the rollout, bounded by
max_staleness, waits for each new version before its next batch and the version arrives while it waits, never
during a generation; partial rollouts switch on generation-bound jobs (long responses, e.g. --set
rollout.ignore_eos=true with --max-new-tokens 96, or a real model).

    verl bench async                          # 12 steps, 1 round, 4 modes
    verl bench async --steps 20 --rounds 2 --warmup 100
    verl bench async --procs 2 --max-new-tokens 24 --tag p2   # 1 + 1 processes, longer responses
    verl bench async --procs 2 --config examples/smollm2_gsm8k.yaml --set data.train_batch_size=4 ...  # real model
Writes benchmarks/results/bench_async[_TAG].json and .md. Each process runs one torch thread; on a machine with
fewer cores than processes the overlapped modes share cores that sync leaves to one side at a time, so the
table says how many cores there were (--procs 2 keeps one process per core on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"],
         "async_s1": ["trainer.mode=async", "algorithm.max_staleness=1"],
         "async_s2": ["trainer.mode=async", "algorithm.max_staleness=2"],
         "async_s2_partial": ["trainer.mode=async", "algorithm.max_staleness=2", "rollout.partial=true"]}
DEFAULT_MODES = ["sync", "one_step_off", "async_s1", "async_s2"]


def job(mode: str, out_dir: str, steps: int, warmup: int, procs: int, max_new_tokens: int,
        extra: list[str] = ()) -> list[str]:
    """The default job (verl/trainer/config/default.yaml), or --config's, with the actor (and reference and
    reward) on the first half of `procs` ranks and the rollout on the second, shortened to `steps`."""
    actor, rollout = list(range(procs // 2)), list(range(procs // 2, procs))
    length = [f"rollout.max_new_tokens={max_new_tokens}"] if max_new_tokens else []
    return [*MODES[mode], *length, *extra, "trainer.placement=split", f"actor.ranks={actor}", f"rollout.ranks={rollout}",
            f"reward.ranks={actor}", f"warmup.steps={warmup}", f"trainer.total_steps={steps}", "trainer.threads=1",
            "trainer.device=cpu", "trainer.save_final=false", "trainer.save_every=0", "trainer.export_hf=false",
            "trainer.plot=false", "trainer.progress_bar=false", "trainer.tensorboard=false",
            f"trainer.output_dir={out_dir}"]


def run(mode: str, work: str, args: argparse.Namespace, port: int) -> dict:
    out = os.path.join(work, mode)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.procs}", "--master_port",
           str(port), "-m", "verl.trainer.main_ppo", *([args.config] if args.config else []),
           *job(mode, out, args.steps, args.warmup, args.procs, args.max_new_tokens, args.set),
           "trainer.overwrite=true"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-2000:]}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "perf/tokens_per_s" in r]
    measured = rows[1:]
    mean = lambda k: sum(r.get(k, 0.0) for r in measured) / len(measured)  # noqa: E731
    last = rows[-3:]
    tokens = sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in measured)
    seconds = measured[-1]["perf/wall_time"] - rows[0]["perf/wall_time"]
    return {"mode": mode, "steps_measured": len(measured), "tokens_per_s": tokens / seconds,
            "step_time_s": mean("perf/step_time_s"), "idle_share_rollout": mean("perf/idle_share_rollout"),
            "idle_share_actor": mean("perf/idle_share_actor"), "staleness_mean": mean("rollout/staleness_mean"),
            "sync_s": mean("perf/sync_s"), "weight_wait_s": mean("rollout/weight_wait_s"),
            "token_staleness_mean": mean("rollout/token_staleness_mean"),
            "switches": sum(r.get("rollout/partial_rebuilds", 0.0) for r in measured),
            "mixed_share": mean("rollout/mixed_version_share"),
            "reward_last": sum(r["reward/mean"] for r in last) / len(last),
            "reward_first": rows[0]["reward/mean"], "load_avg_1min": os.getloadavg()[0],
            "reward_curve": [r["reward/mean"] for r in rows]}


def combine(rounds: list[list[dict]], modes: list[str]) -> list[dict]:
    """Per mode, the mean of its rounds (failed rounds reported as such)."""
    out = []
    for mode in modes:
        ok = [r for rs in rounds for r in rs if r["mode"] == mode and "error" not in r]
        if not ok:
            out.append(next(r for rs in rounds for r in rs if r["mode"] == mode))
            continue
        keys = [k for k in ok[0] if k not in ("mode", "reward_curve")]
        curves = list(zip(*[r["reward_curve"] for r in ok]))  # per step, over the rounds
        out.append({"mode": mode, "rounds": len(ok), **{k: sum(r[k] for r in ok) / len(ok) for k in keys},
                    "reward_curve": [sum(c) / len(c) for c in curves]})
    base = next((r["tokens_per_s"] for r in out if r["mode"] == "sync" and "error" not in r), None)
    for r in out:
        if "error" not in r and base:
            r["speedup_vs_sync"] = r["tokens_per_s"] / base
    return out


def _quarter(curve: list[float], which: int) -> float:
    """The mean reward of the first (which=0) or last (-1) quarter of the steps (at least one step)."""
    q = max(1, len(curve) // 4)
    part = curve[:q] if which == 0 else curve[-q:]
    return sum(part) / len(part)


def markdown(rows: list[dict], meta: dict) -> str:
    half = meta["procs"] // 2
    lines = [f"# verl bench async{' ' + meta['config'] if meta.get('config') else ''} ({meta['cpus']} CPU cores, {meta['procs']} processes: actor ranks "
             f"{list(range(half))}, rollout ranks {list(range(half, meta['procs']))}; {meta['steps']} steps, "
             f"{meta['rounds']} round(s), max_new_tokens {meta['max_new_tokens'] or 'as the default job'})", "",
             "| mode | tokens/s | vs sync | step s | idle rollout | idle actor | staleness | token staleness | "
             "switches | mixed responses | reward, first -> last quarter of the steps |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error'][-200:]!r} | | | | | | | | | |")
            continue
        partial = "rollout.partial=true" in MODES.get(r["mode"], [])
        lines.append(f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r.get('speedup_vs_sync', float('nan')):.2f}x | "
                     f"{r['step_time_s']:.2f} | {100 * r['idle_share_rollout']:.0f}% | "
                     f"{100 * r['idle_share_actor']:.0f}% | {r['staleness_mean']:.2f} | "
                     + (f"{r.get('token_staleness_mean', float('nan')):.2f} | {r.get('switches', 0):.0f} | "
                        f"{100 * r.get('mixed_share', 0.0):.0f}% | " if partial else "- | - | - | ")
                     + f"{_quarter(r['reward_curve'], 0):.3f} -> {_quarter(r['reward_curve'], -1):.3f} |")
    loads = ", ".join(f"{r['mode']} {r['load_avg_1min']:.1f}" for r in rows if "load_avg_1min" in r)
    if loads:
        lines += ["", f"Machine load (1-minute load average after each mode, mean over rounds): {loads}, on "
                      f"{meta['cpus']} cores; a load above the core count (other jobs) makes the figures noisy."]
    lines += ["", f"Command: `{meta['command']}`", "", meta["note"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=100, help="supervised warm-start steps before RL")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of the four modes")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    ap.add_argument("--config", default=None, help="job config (default: the default job)")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides (key=value) for every mode")
    ap.add_argument("--procs", type=int, default=4, choices=[2, 4, 6, 8], help="processes (half actor, half rollout)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response length (0: the default job's)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--quick", action="store_true", help="the default settings (kept for the suite runner)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.rounds):
            rows = []
            for j, mode in enumerate(args.modes):
                rows.append(run(mode, work, args, 29800 + 10 * i + j))
                print(json.dumps(rows[-1]), flush=True)
            rounds.append(rows)
    table = combine(rounds, args.modes)
    meta = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "procs": args.procs,
            "max_new_tokens": args.max_new_tokens, "config": args.config,
            "note": "tokens/s: trained tokens of the steps after the first over the wall-clock time they took. "
                    "Idle share: the share of a step a rank set spends outside its own nodes (sync_weights "
                    "excluded, since a side waits there for the other; in async the rollout's is per batch it "
                    "generates). Staleness: weight versions between a sample's generation and its training. "
                    "With fewer cores than processes the overlapped modes compete for cores that sync uses "
                    "one side at a time."}
    name = "bench_async" + (f"_{args.tag}" if args.tag else "")
    written = write_result(os.path.join(args.out, f"{name}.json"), {"rows": table, "rounds": rounds}, run_info,
                           **meta)
    md = markdown(table, written["meta"])
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all("error" not in r for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
