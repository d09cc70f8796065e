"""What every benchmark writes beside its numbers, so that a results file documents itself: the one command that
reproduces it, the commit it ran at, and how loaded the machine was (the machines these run on are shared).

    run = RunInfo.start()                      # at the start of the benchmark's main()
    ...
    write_result(path, {"rows": rows, ...}, run, note="...")   # meta = run.meta() + the extra keys

`meta.command` is `python <script relative to the repository> <its arguments>`, run from the repository root with
`PYTHONPATH=.` (and, where `meta.environment` names one, that environment's python: scripts/setup_env.sh KIND).
scripts/render_results.py turns these files into docs/benchmarks.md; nothing else writes or merges them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["REPO", "RunInfo", "git_commit", "write_result"]

REPO = Path(__file__).resolve().parents[2]


def git_commit(repo: Path = REPO) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files other than results differ from it), or (None, None) outside a git
    checkout. benchmarks/results/ is left out: a run writing there does not make the next run's code differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                                  ":(exclude)benchmarks/results"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def _environment() -> str | None:
    """The scripts/setup_env.sh environment this python belongs to (venv-KIND-HASH), if any."""
    name = Path(sys.prefix).name
    return name.split("-")[1] if name.startswith("venv-") and name.count("-") >= 2 else None


def _command(argv: list[str]) -> str:
    script = Path(argv[0]).resolve()
    try:
        script_s = script.relative_to(REPO).as_posix()
    except ValueError:
        script_s = argv[0]
    return " ".join(shlex.quote(a) for a in ["python", script_s, *argv[1:]])


@dataclasses.dataclass(slots=True)
class RunInfo:
    """The provenance of one benchmark run, taken at its start (`start`) and completed when it is written."""

    command: str
    started: float
    load_start: float
    commit: str | None
    dirty: bool | None
    """Whether tracked files differed from `commit` when the run started (the code it ran is then not exactly
    the commit's)."""

    @classmethod
    def start(cls, argv: list[str] | None = None, command: str | None = None) -> "RunInfo":
        """`command`: the reproducing command when it is not this process's own (e.g. a test that writes results)."""
        commit, dirty = git_commit()
        return cls(command=command or _command(list(sys.argv if argv is None else argv)), started=time.time(),
                   load_start=os.getloadavg()[0], commit=commit, dirty=dirty)

    def meta(self) -> dict:
        import torch
        return {"command": self.command, "commit": self.commit, "dirty": self.dirty, "environment": _environment(),
                "date_utc": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "wall_s": round(time.time() - self.started, 1),
                "load_avg_1m": {"start": self.load_start, "end": os.getloadavg()[0]}, "cpus": os.cpu_count(),
                "machine": platform.machine(), "cpu_model": cpu_model(), "python": platform.python_version(),
                "torch": torch.__version__}


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo; platform's answer elsewhere): the same job's figures differ between
    the machines a benchmark may land on (an AMD EPYC and an Intel Xeon of 2 cores each, here), so a result
    names its CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def write_result(path: str | os.PathLike, payload: dict, run: RunInfo, **meta) -> dict:
    """Writes `payload` as JSON under `meta` = the benchmark's own keys (`meta` and the payload's "meta") and the
    run's provenance, which no benchmark overrides. Returns what was written."""
    own = payload.get("meta", {})
    out = {"meta": {**own, **meta, **run.meta()}, **{k: v for k, v in payload.items() if k != "meta"}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out
