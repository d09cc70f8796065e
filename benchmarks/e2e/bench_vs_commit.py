"""The example job at an earlier commit and at this checkout, side by side in one window: how much faster the same
job runs now than it did then.

    python benchmarks/e2e/bench_vs_commit.py --baseline 3d01a18 --steps 3             # both at once, 1 thread each
    python benchmarks/e2e/bench_vs_commit.py --baseline 3d01a18 --steps 2 --sequential --rounds 2

Both sides run `verl train examples/smollm2_gsm8k.yaml` (each tree's own copy of the file; the result says whether
their settings differ) with bench_cores.py's overrides (no checkpoints, no exports, no plots): at the same time, one
single-threaded process each, so that both see the same machine and the same outside load; or, with --sequential,
one after the other, each alone on the machine with its example's own trainer.threads (the job as `verl train` runs
it at each commit), --rounds times. The baseline is the commit's tree exported (`git archive`) under
~/.cache/verl/bench-baselines/<sha> with its own verl._C built there (the CPU build, as scripts/setup_env.sh builds
it); its import location is checked before it runs. Run together, this checkout runs up to 3x --steps steps and is
stopped when the baseline finishes, so that neither side runs alone. The same steps are compared on both sides
(the same prompts, and the same samples where both sample alike): from the second (the first is warm-up) to the
last this checkout finished while the baseline was still running. Reported per side: generated (response) tokens
per second of wall time and trained tokens per second (the job's perf/response_tokens_per_s and perf/tokens_per_s,
summed over the counted steps), the phases per step, the mean response length, the ratio now / baseline, and each
paired step's time ratio. Writes benchmarks/results/bench_vs_commit.json (--out).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.e2e.bench_cores import COMMON as JOB  # noqa: E402  (the example's run, nothing written but metrics)

EXAMPLE = os.path.join("examples", "smollm2_gsm8k.yaml")
PHASES = ("timing/generate_s", "timing/old_log_prob_s", "timing/update_actor_s", "timing/sync_weights_s")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(rev: str) -> tuple[str, str]:
    """(sha, directory) of `rev`'s tree with its verl._C built."""
    sha = _git("rev-parse", f"{rev}^{{commit}}")
    where = os.path.join(os.path.expanduser("~"), ".cache", "verl", "bench-baselines", sha)
    if not os.path.isfile(os.path.join(where, ".built")):
        os.makedirs(where, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(where, filter="data")
        print(f"[vs-commit] building verl._C of {sha[:10]} in {where}", flush=True)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--build-temp", "build/cpu/temp"],
                       cwd=where, check=True, env=dict(os.environ, VERL_BUILD_CUDA="0"))
        open(os.path.join(where, ".built"), "w").close()
    return sha, where


def _env(tree: str, one_thread: bool = True) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop("OMP_NUM_THREADS", None)
    return env


def _check_import(tree: str) -> None:
    where = subprocess.run([sys.executable, "-c", "import torch, verl, verl._C; print(verl.__file__)"], cwd=tree,
                           env=_env(tree), check=True, capture_output=True, text=True).stdout.strip()
    if not where.startswith(tree):
        raise SystemExit(f"the run in {tree} imports verl from {where}: it would not run that tree's code")


def _rows(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if "perf/step_time_s" in r]


def summarize(rows: list[dict], counted: list[dict]) -> dict:
    """The side's figures over its `counted` steps (of `rows`, every step it logged)."""
    if not counted:
        return {"steps_counted": 0}
    seconds = sum(r["perf/step_time_s"] for r in counted)
    mean = lambda key: sum(r.get(key) or 0.0 for r in counted) / len(counted)  # noqa: E731
    return {"steps_counted": len(counted), "steps_run": len(rows), "step_s": seconds / len(counted),
            "response_tokens_per_s": sum(r["perf/response_tokens_per_s"] * r["perf/step_time_s"]
                                         for r in counted) / seconds,
            "tokens_per_s": sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in counted) / seconds,
            "phases_s": {k: mean(k) for k in PHASES}, "response_length": mean("response/length"),
            "step_s_each": [r["perf/step_time_s"] for r in rows], "reward_mean_each": [r.get("reward/mean")
                                                                                       for r in rows]}


def run_round(sides: dict, overrides: list[str], together: bool, work: str) -> dict[str, list[dict]]:
    """Runs both sides once (together, or the baseline then this checkout); each side's logged steps."""
    os.makedirs(work, exist_ok=True)
    procs, outs = {}, {}
    for name, (tree, steps) in sides.items():
        outs[name] = os.path.join(work, name)
        cmd = [sys.executable, "-m", "verl.cli.main", "train", EXAMPLE, f"trainer.total_steps={steps}",
               f"trainer.output_dir={outs[name]}", *overrides]
        log = open(os.path.join(work, f"{name}.log"), "w")
        procs[name] = subprocess.Popen(cmd, cwd=tree, env=_env(tree, together), stdout=log,
                                       stderr=subprocess.STDOUT)
        print(f"[vs-commit] {name}: {' '.join(cmd[1:])} (in {tree})", flush=True)
        if not together:
            procs[name].wait()
    while procs["baseline"].poll() is None:
        time.sleep(5)
        if procs["now"].poll() not in (None, 0):
            break
    for name in ("baseline", "now"):
        if procs[name].poll() is None:
            procs[name].terminate()
            procs[name].wait(60)
    if procs["baseline"].returncode != 0:
        raise SystemExit(f"the baseline run failed (rc {procs['baseline'].returncode}): {work}/baseline.log")
    rows = {name: _rows(outs[name]) for name in sides}
    for name, r in rows.items():
        if len(r) < 2:
            raise SystemExit(f"{name} logged {len(r)} steps: {work}/{name}.log")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--steps", type=int, default=3, help="the baseline's steps (its first is warm-up)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the baseline, then this checkout, each alone and with its example's own "
                         "trainer.threads (what `verl train` of each does), instead of both at once on one thread")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --sequential: repeat the pair (baseline, then this checkout) this many times")
    ap.add_argument("--work", default=None, help="run folders (default: a temporary folder)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_vs_commit.json"))
    args = ap.parse_args()
    import tempfile

    from verl.utils.results import RunInfo, write_result
    info = RunInfo.start()
    sha, base = baseline_tree(args.baseline)
    _check_import(base)
    _check_import(ROOT)
    work = args.work or tempfile.mkdtemp(prefix="verl-vs-commit-")
    os.makedirs(work, exist_ok=True)
    import yaml
    # the settings, comments aside
    same_yaml = yaml.safe_load(open(os.path.join(base, EXAMPLE))) == yaml.safe_load(open(os.path.join(ROOT, EXAMPLE)))
    yaml_diff = "" if same_yaml else _git("diff", sha, "--", EXAMPLE)
    together = not args.sequential
    overrides = [*JOB, "trainer.threads=1"] if together else JOB
    sides = {"baseline": (base, args.steps), "now": (ROOT, 3 * args.steps if together else args.steps)}
    rounds = args.rounds if not together else 1
    counted: dict[str, list] = {"baseline": [], "now": []}
    logged: dict[str, list] = {"baseline": [], "now": []}
    paired_steps, ratios = [], []
    for r in range(rounds):
        rows = run_round(sides, overrides, together, os.path.join(work, f"round{r}") if rounds > 1 else work)
        # The same steps on both sides (the same prompts; the same samples where both sample alike), from the
        # second on, each finished by this checkout while the baseline was still running (so that neither ran
        # alone) when they run together.
        end = rows["baseline"][-1]["perf/wall_time"]
        paired = [i for i in range(1, min(len(rows["baseline"]), len(rows["now"])))
                  if rows["now"][i]["perf/wall_time"] <= end or not together]
        for name in rows:
            counted[name] += [rows[name][i] for i in paired]
            logged[name] += rows[name]
        paired_steps += [i + 1 for i in paired]
        ratios += [rows["baseline"][i]["perf/step_time_s"] / rows["now"][i]["perf/step_time_s"] for i in paired]
    res = {"baseline": {"commit": sha, **summarize(logged["baseline"], counted["baseline"])},
           "now": {"commit": info.commit, "dirty": info.dirty, **summarize(logged["now"], counted["now"])},
           "rounds": rounds, "steps_paired": paired_steps, "step_ratios": ratios,
           "example_same_at_both": same_yaml, "example_diff": yaml_diff, "overrides": overrides,
           "schedule": "together, one thread each" if together else "one after the other, each alone with its "
                                                                    "example's own trainer.threads"}
    b, n = res["baseline"], res["now"]
    if b["steps_counted"] and n["steps_counted"]:
        res["response_tokens_per_s_ratio"] = n["response_tokens_per_s"] / b["response_tokens_per_s"]
        res["tokens_per_s_ratio"] = n["tokens_per_s"] / b["tokens_per_s"]
        print(f"[vs-commit] generated tokens/s: baseline {b['response_tokens_per_s']:.1f}, now "
              f"{n['response_tokens_per_s']:.1f} ({res['response_tokens_per_s_ratio']:.2f}x); trained tokens/s "
              f"{res['tokens_per_s_ratio']:.2f}x; steps counted {b['steps_counted']} / {n['steps_counted']}",
              flush=True)
    write_result(args.out, {"benchmark": "vs_commit", "job": f"verl train {EXAMPLE}", **res}, info)
    print(f"[vs-commit] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
