"""Runs the adversarial reliability suite (tests/reliability) and prints its cases counted by category.

    python scripts/reliability_report.py                      # the whole suite; exit 0 when the targets hold
    python scripts/reliability_report.py -m "not slow"        # extra arguments go to pytest
    python scripts/reliability_report.py --json report.json   # also write every case with its category

A case is a test whose function name says what it expects of verl:
    test_clear_*    a bad input, fault or signal must end in a clear error that names the input / node / rank
    test_behaves_*  an edge or fault must be handled correctly (right result, fallback, nothing lost)
Other tests in the folder (helpers, table-size checks) run but are not cases.

Each case's outcome becomes one category:
    clear    a test_clear_ case passed                 behaves  a test_behaves_ case passed
    silent   no error where one was due ("DID NOT RAISE"), or a test_behaves_ case got a wrong result
    unclear  an error came, but its message or type did not meet the case's assertions
    crash    an unexpected raw exception escaped, or the test process died (segfault, abort, os._exit)
    hang     the case overran its own bound (its failure says HANG) or the per-test timeout (--timeout)
    error    the test could not run (a fixture or setup failed)    skipped: not run here (no GPU, ...)
Targets: 0 silent, 0 unclear, 0 crash, 0 hang, 0 error, and at least --min-cases cases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/reliability"
CATEGORIES = ("clear", "behaves", "silent", "unclear", "crash", "hang", "error")
BAD = ("silent", "unclear", "crash", "hang", "error")


def declared(nodeid: str) -> str | None:
    """'clear' / 'behaves' from the test function's name; None for a test that is not a case."""
    name = nodeid.split("[")[0].split("::")[-1]  # parameter ids may contain "::" themselves
    for cat in ("clear", "behaves"):
        if name.startswith(f"test_{cat}_"):
            return cat
    return None


def classify(nodeid: str, when: str, outcome: str, crash: str, text: str) -> str:
    """The category of one finished test (see the module docstring)."""
    want = declared(nodeid)
    if outcome == "skipped":
        return "skipped"
    if outcome == "passed":
        return want or "support"
    if "HANG" in text or "Timeout" in crash or "TimeoutExpired" in crash:
        return "hang"
    if when != "call":
        return "error"
    if "DID NOT RAISE" in crash:
        return "silent"
    if crash.startswith(("AssertionError", "Failed:", "assert ")):
        return "unclear" if want == "clear" else "silent"
    return "crash"


# ---- the pytest side: one JSON line per test, written as it happens -------------------------------------------
class Recorder:
    """A pytest plugin: a 'start' line before each test and a result line after each phase that decides it."""

    def __init__(self, path: str):
        self.out = open(path, "a", buffering=1)

    def _write(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def pytest_runtest_logstart(self, nodeid, location):
        self._write({"start": nodeid})

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or ""
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                crash = str(report.longrepr[2])
            self._write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                         "crash": crash[:2000], "text": (report.longreprtext or "")[-6000:],
                         "duration": round(report.duration, 2)})


def _worker(out: str, pytest_args: list[str]) -> int:
    import pytest
    return int(pytest.main(pytest_args, plugins=[Recorder(out)]))


# ---- the runner ---------------------------------------------------------------------------------------------
def _run_pytest(suite: str, args: list[str], lines: Path, deselect: list[str], timeout_s: float) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--worker", str(lines), "--", suite, "-q", "-p", "no:cacheprovider",
           f"--timeout={timeout_s:g}", "--timeout-method=thread", *args]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def run_suite(suite: str, args: list[str], timeout_s: float, max_restarts: int = 20) -> dict[str, dict]:
    """Every test's final record, keyed by node id. A test during which pytest itself died is recorded as a
    crash (or a hang, when pytest-timeout killed it) and pytest is restarted without the tests already done."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(max_restarts + 1):
            lines = Path(tmp) / f"run{attempt}.jsonl"
            lines.touch()
            code, output = _run_pytest(suite, args, lines, sorted(results), timeout_s)
            finished, last = set(), None
            for line in lines.read_text().splitlines():
                rec = json.loads(line)
                if "start" in rec:
                    last = rec["start"]
                    continue
                prev = results.get(rec["nodeid"])
                if prev is None or prev["outcome"] == "passed":  # a failing teardown overrides a passed call
                    results[rec["nodeid"]] = rec
                if rec["when"] == "call" or rec["outcome"] != "passed":
                    finished.add(rec["nodeid"])
            running = last if last is not None and last not in finished else None
            if running is None:
                break
            timed_out = "Timeout" in output
            results[running] = {"nodeid": running, "when": "call", "outcome": "failed",
                                "crash": "Timeout (pytest-timeout ended the run)" if timed_out else
                                f"the test process died (pytest exit code {code})", "text": output[-6000:],
                                "duration": None}
    return results


def report(results: dict[str, dict], min_cases: int) -> tuple[str, bool, list[dict]]:
    rows = []
    for nodeid, rec in sorted(results.items()):
        cat = classify(nodeid, rec["when"], rec["outcome"], rec["crash"], rec["text"])
        rows.append({"case": nodeid, "category": cat, "declared": declared(nodeid), "why": rec["crash"][:300],
                     "duration_s": rec["duration"]})
    counts = Counter(r["category"] for r in rows)
    total = sum(counts[c] for c in CATEGORIES)
    by_file: dict[str, Counter] = {}
    for r in rows:
        by_file.setdefault(r["case"].split("::")[0], Counter())[r["category"]] += 1
    out = [f"reliability suite: {total} cases"]
    out.append("  " + "  ".join(f"{c}={counts[c]}" for c in CATEGORIES)
               + f"   (skipped={counts['skipped']}, support tests={counts['support']})")
    width = max(len(f) for f in by_file) if by_file else 10
    for f, c in sorted(by_file.items()):
        out.append(f"  {f:<{width}}  " + "  ".join(f"{k}={c[k]}" for k in CATEGORIES if c[k])
                   + (f"  skipped={c['skipped']}" if c["skipped"] else ""))
    bad = [r for r in rows if r["category"] in BAD]
    for r in bad:
        out.append(f"  {r['category'].upper():8} {r['case']}: {r['why']}")
    ok = not bad and total >= min_cases
    out.append(f"targets: 0 silent/unclear/crash/hang/error -> {'met' if not bad else 'NOT met'}; "
               f">= {min_cases} cases -> {'met' if total >= min_cases else 'NOT met'}")
    return "\n".join(out), ok, rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="per-test limit (pytest-timeout), seconds")
    parser.add_argument("--min-cases", type=int, default=250, help="the suite's size target")
    parser.add_argument("--json", help="write every case with its category here")
    parser.add_argument("--suite", default=SUITE, help="the folder (or test file) to run")
    known, rest = parser.parse_known_args(argv)
    results = run_suite(known.suite, rest, known.timeout)
    text, ok, rows = report(results, known.min_cases)
    print(text)
    if known.json:
        Path(known.json).write_text(json.dumps({"cases": rows, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
