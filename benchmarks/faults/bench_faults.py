"""Elastic recovery under faults: the default job on 2 processes under `torchrun --max-restarts`, with a fault
injector that SIGKILLs a random worker at random times, against the same job uninterrupted, side by side.

Per mode (sync, one_step_off, async, async_partial): --runs pairs of an uninterrupted run and the same job with
faults, one after the other, so that the machine's drift over time (a 2-core machine shared by both processes
varies by 5-10% from run to run) falls on both sides alike. The injector starts once the first step is logged and
kills a random rank (a child of torchrun's agent) every --fault-every seconds (uniform in [0.5, 1.5] x that),
wherever the job is: in a step, in the weight sync, a checkpoint save, the async queue's transfer, or a restart's
setup. torchrun restarts the worker group and the trainer continues by itself (trainer.recovery=auto: the newest
snapshot every rank holds, else the newest checkpoint). Reported per mode (`summary`, from the pairs in `rows`):

- goodput: the uninterrupted runs' wall time over the faulty runs' (the share of the time that went into work
  that counts), pooled over the pairs, each pair's beside it, and each run's step-time share (the final metrics
  series' step times over the wall time: the start and the warm-up are not steps);
- recovery time per fault (kill -> the next step logged) and its split, from what the restarted rank 0 logs:
  agent restart (kill -> the new process started), start (interpreter, imports, data, tokenizer and model),
  restore (resolving the run, building the workers, loading the snapshot, the first weight sync), first step;
- steps redone per fault (the last step logged before the kill minus the step restored);
- whether the final weights (hf_actor) equal the uninterrupted run's bit for bit, whether the metrics series
  (timings aside) are equal, and the exactly-once check on samples.jsonl: per epoch, data indices trained twice
  and indices the uninterrupted run trained that this one skipped. Async runs with trainer.async_versions=pinned
  (batch b generated with exactly version b - lag; with `newest` the version can depend on timing); their rollout's
  rank snapshots the batches its queue holds with each batch. With 2 pairs or more the uninterrupted runs of a
  mode are compared with each other too (the job is reproducible, so their weights are equal).
  async_partial: async with partial rollouts (rollout.partial=true), pinned too: batch b's tokens switch from
  version b - lag to b - lag + 1 at a fixed token (rollout.partial_switch_token).

The work is equal on both sides: the same config, seed, data order and steps; only the kills differ.

    verl bench faults                                               # all four modes, 1 pair each
    python benchmarks/faults/bench_faults.py --modes sync --runs 4 --fault-every 8 --steps 60 --out X.json

Writes benchmarks/results/bench_faults.json (meta.command) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from verl.utils.metrics import metrics_view, read_metrics  # noqa: E402

MODES = {
    "sync": [],
    # the rollout on a rank of its own, as these modes need (examples/one_step_off.yaml, on 2 processes); they
    # validate in sync mode only
    "one_step_off": ["trainer.mode=one_step_off", "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
                     "reward.ranks=[0]", "algorithm.rollout_correction.is_level=token", "val.num_examples=0"],
    # async: each batch with exactly the weight version the schedule names (reproducible)
    "async": ["trainer.mode=async", "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
              "reward.ranks=[0]", "algorithm.max_staleness=1", "algorithm.rollout_correction.is_level=token",
              "val.num_examples=0", "trainer.async_versions=pinned"],
}
# async with partial rollouts, pinned too: each batch's tokens switch to the next version at a fixed token (half of
# the default job's 6), so a rollout killed mid-batch regenerates it with the same versions
MODES["async_partial"] = [*MODES["async"], "rollout.partial=true"]
# rollout/weight_wait_s: seconds async generation waited for a weight version (a timing, like timing/*)
VOLATILE = ("perf/", "timing/", "recovery/", "resumed_from_step", "rollout/weight_wait_s")


def steps_logged(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def run_job(out: Path, overrides: list[str], *, faults: bool, rng: random.Random, fault_every: float,
            max_restarts: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", "verl.trainer.main_ppo",
           f"trainer.output_dir={out}", "trainer.progress_bar=false", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    kills, next_kill = [], None
    with log.open("w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
        while p.poll() is None:
            time.sleep(0.05)
            if not faults:
                continue
            if next_kill is None:
                if any("reward/mean" in r for r in steps_logged(out)):
                    next_kill = time.time() + rng.uniform(0.5, 1.5) * fault_every
                continue
            if time.time() < next_kill:
                continue
            kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            if kids:
                victim = int(rng.choice(kids))
                done = [r["step"] for r in steps_logged(out) if "reward/mean" in r]
                try:
                    os.kill(victim, signal.SIGKILL)
                    kills.append({"time": time.time(), "last_step": done[-1] if done else 0})
                except ProcessLookupError:
                    pass
            next_kill = time.time() + rng.uniform(0.5, 1.5) * fault_every
    wall = time.time() - t0
    return {"rc": p.returncode, "wall_s": wall, "kills": kills, "start": t0}


def analyse(out: Path, job: dict) -> dict:
    """The run's goodput and, per kill, its recovery. A kill that lands before the previous one's recovery ended
    (the next step logged) is counted as one `during_recovery`: its recovery is the one that ends both."""
    records = read_metrics(out / "metrics.jsonl")
    series = [r for r in metrics_view(records) if "reward/mean" in r]
    counted = sum(r["perf/step_time_s"] for r in series)
    kills = job["kills"]
    faults = []
    for n, k in enumerate(kills):
        next_kill = kills[n + 1]["time"] if n + 1 < len(kills) else float("inf")
        row = {"last_step": k["last_step"], "kill_time": k["time"] - job["start"]}
        before = max((i for i, r in enumerate(records) if r.get("perf/wall_time", float("inf")) < k["time"]),
                     default=-1)
        marker = next((r for r in records[before + 1:] if "resumed_from_step" in r), None)
        restart = next((i for i in range(before + 1, len(records)) if "recovery/ready_time" in records[i]), None)
        resume = None if restart is None else records[restart]
        # the first step the restarted workers finished (a rank still alive may log one more step after the kill)
        after = [] if restart is None else [r for r in records[restart + 1:] if "reward/mean" in r]
        if not after or after[0]["perf/wall_time"] > next_kill:
            row["during_recovery"] = True  # or after the last step: recovered by the next kill's restart
            faults.append(row)
            continue
        row["recovery_s"] = after[0]["perf/wall_time"] - k["time"]
        if marker is not None:
            row["redone_steps"] = k["last_step"] - marker["resumed_from_step"]
        if resume is not None:
            start = resume.get("recovery/process_start_time")
            row["split_s"] = {"agent_restart": (start - k["time"]) if start else None,
                              "start": (resume["recovery/setup_start_time"] - start) if start else None,
                              "restore": resume["recovery/ready_time"] - resume["recovery/setup_start_time"],
                              "first_step": after[0]["perf/wall_time"] - resume["recovery/ready_time"]}
        faults.append(row)
    snaps = [r["perf/snapshot_s"] for r in series if "perf/snapshot_s" in r]
    steps = [r["perf/step_time_s"] for r in series]
    return {"steps": len(series), "step_time_share": counted / job["wall_s"], "wall_s": job["wall_s"],
            "rc": job["rc"], "faults": faults, "kills": len(kills), **recoveries(faults),
            "snapshot_s_median": statistics.median(snaps) if snaps else None,
            "step_s_median": statistics.median(steps) if steps else None,
            "snapshot_share": (statistics.median(snaps) / statistics.median(steps)) if snaps and steps else None}


def recoveries(faults: list[dict]) -> dict:
    """Over the kills whose recovery was measured (isolated): their count, recovery median / max, the median of
    each part of the split, and the most steps redone."""
    isolated = [f for f in faults if "recovery_s" in f]
    split = {}
    for part in ("agent_restart", "start", "restore", "first_step"):
        vals = [f["split_s"][part] for f in isolated if f.get("split_s", {}).get(part) is not None]
        split[part] = statistics.median(vals) if vals else None
    return {"isolated_faults": len(isolated),
            "recovery_s_median": statistics.median([f["recovery_s"] for f in isolated]) if isolated else None,
            "recovery_s_max": max([f["recovery_s"] for f in isolated]) if isolated else None,
            "split_s_median": split,
            "redone_steps_max": max([f.get("redone_steps", 0) for f in isolated], default=None)}


def first_difference(a: dict, b: dict) -> dict | None:
    """The first step whose values differ between two series, with those keys (None: equal)."""
    for step in sorted(set(a) | set(b)):
        x, y = a.get(step, {}), b.get(step, {})
        if x != y:
            return {"step": step, "values": {k: [x.get(k), y.get(k)] for k in sorted(set(x) | set(y))
                                             if x.get(k) != y.get(k)}}
    return None


def comparable(out: Path, name: str) -> dict:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
            for r in metrics_view(read_metrics(out / name)) if "reward/mean" in r or "data_indices" in r}


def weights_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file
    wa, wb = load_file(str(a / "hf_actor" / "model.safetensors")), load_file(str(b / "hf_actor" / "model.safetensors"))
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def exactly_once(clean: Path, faulty: Path, batch: int) -> dict:
    """Per epoch: indices trained more than once, and the clean run's indices never trained. An epoch is
    rows // batch steps (the sampler drops the tail), rows the training rows (the largest index the clean run
    trained + 1: every row is drawn in an epoch but the tail's)."""
    a, b = comparable(clean, "samples.jsonl"), comparable(faulty, "samples.jsonl")
    rows = 1 + max(i for r in a.values() for i in r["data_indices"])
    per_epoch = rows // batch
    dup = skipped = trained = 0
    for start in range(1, max(a) + 1, per_epoch):
        got = [i for s in range(start, start + per_epoch) for i in b.get(s, {}).get("data_indices", [])]
        want = {i for s in range(start, start + per_epoch) for i in a.get(s, {}).get("data_indices", [])}
        dup += len(got) - len(set(got))
        skipped += len(want - set(got))
        trained += len(got)
    return {"indices_trained": trained, "duplicates": dup, "skipped": skipped}


def summarize(mode: str, runs: list[dict]) -> dict:
    """One row per mode over its pairs: goodput pooled (the uninterrupted runs' wall time over the faulty runs'),
    each pair's beside it, the recoveries of every run together, and the checks of every run."""
    ok = [r for r in runs if r.get("rc") == 0]
    shares = [r["uninterrupted"]["snapshot_share"] for r in ok if r["uninterrupted"].get("snapshot_share")]
    diffs = [r["metrics_first_difference"] for r in ok if r.get("metrics_first_difference")]
    controls = [r["uninterrupted_twice_weights_equal"] for r in ok if "uninterrupted_twice_weights_equal" in r]
    return {"mode": mode, "pairs": len(runs), "rc": 0 if ok and len(ok) == len(runs) else 1,
            "kills": sum(r["kills"] for r in ok), **recoveries([f for r in ok for f in r["faults"]]),
            "goodput": (sum(r["uninterrupted"]["wall_s"] for r in ok) / sum(r["wall_s"] for r in ok)) if ok else None,
            "goodput_runs": [r["goodput"] for r in ok],
            "uninterrupted": {"snapshot_share": statistics.median(shares) if shares else None},
            "weights_equal": all(r["weights_equal"] for r in ok), "metrics_equal": not diffs,
            "metrics_first_difference": diffs[0] if diffs else None,
            "exactly_once": {k: sum(r["exactly_once"][k] for r in ok) for k in ("indices_trained", "duplicates",
                                                                                "skipped")},
            **({"uninterrupted_twice_weights_equal": all(controls)} if controls else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="sync,one_step_off,async,async_partial")
    ap.add_argument("--steps", type=int, default=200, help="trainer.total_steps (the default job's)")
    ap.add_argument("--runs", type=int, default=1,
                    help="pairs per mode: an uninterrupted run, then the same job with faults")
    ap.add_argument("--fault-every", type=float, default=30.0, help="mean seconds between kills")
    ap.add_argument("--max-restarts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_faults.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="verl-bench-faults-"))
    common = [f"trainer.total_steps={args.steps}", "trainer.save_every=20", "trainer.tensorboard=false",
              "trainer.plot=false"]
    rows, summary = [], []
    meta = {"job": "the default job (verl/trainer/config/default.yaml), 2 processes", "fault_every_s": args.fault_every,
            "steps": args.steps}
    try:
        for mode in args.modes.split(","):
            overrides = [*common, *MODES[mode]]
            runs, first_clean = [], None
            for i in range(args.runs):  # pairs: an uninterrupted run, then the same job with faults
                clean = work / f"{mode}_clean_{i}"
                base = analyse(clean, run_job(clean, overrides, faults=False, rng=rng, fault_every=args.fault_every,
                                              max_restarts=args.max_restarts, log=work / f"{mode}_clean_{i}.log"))
                share = base["snapshot_share"]
                snap = "no snapshots" if share is None else f"snapshot {share:.1%} of a step"
                print(f"{mode} pair {i}: uninterrupted {base['wall_s']:.1f} s, {base['steps']} steps, step time "
                      f"share {base['step_time_share']:.1%}, {snap}", flush=True)
                control = None
                if first_clean is None:
                    first_clean = clean
                else:  # every mode is reproducible (async with pinned versions): the clean runs agree
                    control = weights_equal(first_clean, clean)
                out = work / f"{mode}_faults_{i}"
                job = run_job(out, overrides, faults=True, rng=rng, fault_every=args.fault_every,
                              max_restarts=args.max_restarts, log=work / f"{mode}_faults_{i}.log")
                res = analyse(out, job) if job["rc"] == 0 else {"rc": job["rc"], "restarts": len(job["kills"])}
                if job["rc"] == 0:
                    res["weights_equal"] = weights_equal(clean, out)
                    diff = first_difference(comparable(clean, "metrics.jsonl"), comparable(out, "metrics.jsonl"))
                    res["metrics_equal"] = diff is None
                    res["metrics_first_difference"] = diff
                    res["goodput"] = base["wall_s"] / res["wall_s"]  # the uninterrupted run's time over this one's
                    res["exactly_once"] = exactly_once(clean, out, batch=32)  # the default job's prompts per step
                else:
                    res["log_tail"] = (work / f"{mode}_faults_{i}.log").read_text()[-3000:]
                runs.append({"mode": mode, "run": i, "uninterrupted": base, **res,
                             **({"uninterrupted_twice_weights_equal": control} if control is not None else {})})
                print(f"{mode} run {i}: rc {job['rc']}, {len(job['kills'])} kills ({res.get('isolated_faults')} "
                      f"isolated), goodput {res.get('goodput', 0):.1%}, recovery median "
                      f"{res.get('recovery_s_median')} s (split {res.get('split_s_median')}), redone steps max "
                      f"{res.get('redone_steps_max')}, weights equal {res.get('weights_equal')}, metrics equal "
                      f"{res.get('metrics_equal')}, exactly once {res.get('exactly_once')}", flush=True)
                for old in (out, clean) if clean != first_clean else (out,):
                    shutil.rmtree(old, ignore_errors=True)
            rows += runs
            summary.append(summarize(mode, runs))
            print(f"{mode}: goodput {summary[-1]['goodput']:.1%} over {args.runs} pair(s) "
                  f"({', '.join(f'{g:.1%}' for g in summary[-1]['goodput_runs'])})", flush=True)
            write_result(args.out, {"summary": summary, "rows": rows}, run, partial=True, **meta)  # so far
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, {"summary": summary, "rows": rows}, run, partial=False, **meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
