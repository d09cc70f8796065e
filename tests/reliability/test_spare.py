"""Warm spares (verl.utils.spare), with a small stand-in for torchrun's agent: a worker's first start forks its
rank's spare; a restarted worker hands its arguments, environment and stdio over and exits with the code of the
trainer that ran in the spare's fork; a proxy killed takes that trainer with it; the spare leaves with the agent.
tests/reliability/test_recovery.py runs the real thing under torchrun."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import os, sys, time
sys.path.insert(0, {root!r})
from verl.utils import spare

def run(argv):
    print(json.dumps({{"pid": os.getpid(), "restart": os.environ["TORCHELASTIC_RESTART_COUNT"], "argv": argv,
                       "cwd": os.getcwd(), "spare": spare.started_by_spare()}}), flush=True)
    if argv[0] == "sleep":
        time.sleep(60)
    return int(argv[1])

spare.hand_over(sys.argv[1:])
import json  # the worker's heavy imports would be here
spare.start_spare(run)
sys.exit(run(sys.argv[1:]))
"""

AGENT = """
import json, os, signal, subprocess, sys, time
worker, out = sys.argv[1], sys.argv[2]
env = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}
results = []
for restart, args in enumerate([["exit", "0"], ["exit", "7"], ["sleep", "0"]]):
    p = subprocess.Popen([sys.executable, worker, *args], env={**env, "TORCHELASTIC_RESTART_COUNT": str(restart)},
                         stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(worker))
    line = json.loads(p.stdout.readline())
    if args[0] == "sleep":  # what the fault injector does: SIGKILL the rank torchrun watches
        p.kill()
    p.wait()
    line.update(proxy=p.pid, rc=p.returncode)
    results.append(line)
json.dump({"agent": os.getpid(), "runs": results}, open(out, "w"))
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_behaves_restarted_workers_run_in_the_spare_and_end_with_their_proxy(tmp_path):
    worker, agent, out = tmp_path / "worker.py", tmp_path / "agent.py", tmp_path / "out.json"
    worker.write_text(WORKER.format(root=str(ROOT)))
    agent.write_text(AGENT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "VERL_SPARE")}
    p = subprocess.run([sys.executable, str(agent), str(worker), str(out)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    first, second, third = res["runs"]
    from verl.utils.spare import supported
    if not supported():  # a CUDA build of torch: every worker starts as usual, as with VERL_SPARE=0 below
        assert all(r["pid"] == r["proxy"] and not r["spare"] for r in res["runs"]) and second["rc"] == 7
        return
    # the first start runs in the worker itself (and forks the spare); restarts run in forks of the spare, with the
    # restarted worker's arguments, environment and working directory, and its exit code is the proxy's
    assert first["pid"] == first["proxy"] and not first["spare"] and first["rc"] == 0
    assert second["pid"] != second["proxy"] and second["spare"] and second["restart"] == "1"
    assert second["argv"] == ["exit", "7"] and second["rc"] == 7 and second["cwd"] == str(tmp_path)
    # the proxy SIGKILLed: the trainer in the spare's fork dies with it
    assert third["spare"] and third["rc"] == -9 and _gone(third["pid"], 5)
    # the agent gone, the spare leaves and takes its socket along
    sockets = os.path.join(tempfile.gettempdir(), f"verl-spare-{res['agent']}-*.sock")
    deadline = time.monotonic() + 5
    while glob.glob(sockets) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not glob.glob(sockets)


def test_clear_verl_spare_0_starts_every_worker_as_usual(tmp_path):
    worker, agent, out = tmp_path / "worker.py", tmp_path / "agent.py", tmp_path / "out.json"
    worker.write_text(WORKER.format(root=str(ROOT)))
    agent.write_text(AGENT.replace('["exit", "0"], ["exit", "7"], ["sleep", "0"]', '["exit", "0"], ["exit", "3"]'))
    env = {**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}, "VERL_SPARE": "0"}
    p = subprocess.run([sys.executable, str(agent), str(worker), str(out)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["pid"] == r["proxy"] and not r["spare"] for r in runs] == [True, True] and runs[1]["rc"] == 3
