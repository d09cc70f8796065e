"""Per-call cost of the Python sandbox (verl.agents.sandbox), side by side with an unsandboxed interpreter start.

    python benchmarks/agent/bench_sandbox.py            # ~30 s on a shared 2-core machine

Measured in one run, interleaved so both sides see the same machine load, with the sandbox at the caller's
priority (`--nice 0`, equal to the plain side; the default `SandboxLimits.nice=10` deliberately yields to other
load, which on a shared machine measures the neighbours rather than the sandbox):
  1. sequential latency of `run_python("pass")` against `subprocess.run([python, "-E", "-s", "-u", "-B", "-c",
     "pass"])` (the same interpreter with the same flags in its own session, no isolation): medians, and the
     sandbox's own overhead as their difference and ratio;
  2. throughput of `concurrency` calls at once from threads (calls/s, median of 5 interleaved rounds), against
     the same number of plain interpreter starts from threads.
Writes benchmarks/results/bench_sandbox.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from verl.agents.sandbox import SandboxLimits, run_python, sandbox_available  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results")
PLAIN = [sys.executable, "-E", "-s", "-u", "-B", "-c", "pass"]


NICE = [0]


def sandboxed() -> None:
    result = run_python("pass", SandboxLimits(wall_s=60.0, nice=NICE[0]))
    assert result.ok, result.observation()


def plain() -> None:
    # its own session, as the sandboxed program has: the same scheduler-autogroup treatment on both sides
    subprocess.run(PLAIN, check=True, env={"PATH": "/usr/bin:/bin"}, start_new_session=True)


def latency(repeats: int) -> dict:
    times: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for _ in range(repeats):
        for name, fn in (("sandbox", sandboxed), ("plain", plain)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"repeats": repeats, "sandbox_median_ms": med["sandbox"] * 1e3, "plain_median_ms": med["plain"] * 1e3,
            "sandbox_best_ms": min(times["sandbox"]) * 1e3, "plain_best_ms": min(times["plain"]) * 1e3,
            "overhead_median_ms": (med["sandbox"] - med["plain"]) * 1e3, "ratio_median": med["sandbox"] / med["plain"]}


def throughput(concurrency: int, calls: int, rounds: int) -> dict:
    rates: dict[str, list[float]] = {"sandbox": [], "plain": []}
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for _ in range(rounds):  # interleaved rounds: both sides see the same load on a shared machine
            for name, fn in (("sandbox", sandboxed), ("plain", plain)):
                t = time.perf_counter()
                list(pool.map(lambda _: fn(), range(calls)))
                rates[name].append(calls / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"concurrency": concurrency, "calls_per_round": calls, "rounds": rounds,
            "sandbox_calls_per_s": med["sandbox"], "plain_calls_per_s": med["plain"],
            "ratio": med["sandbox"] / med["plain"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--nice", type=int, default=0, help="SandboxLimits.nice (0: the plain side's priority)")
    args = parser.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    NICE[0] = args.nice
    ok, how = sandbox_available()
    if not ok:
        raise SystemExit(f"bench_sandbox: {how}")
    sandboxed(), plain()  # warm the page cache and the sandbox's layout cache
    rows = {"latency": latency(args.repeats), "throughput": throughput(args.concurrency, 2 * args.concurrency, 5)}
    write_result(os.path.join(RESULTS, "bench_sandbox.json"), rows, run, isolation=how, nice=args.nice,
                 kernel=platform.release())
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
