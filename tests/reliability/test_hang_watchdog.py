"""The hang watchdog (trainer.hang_timeout_s, verl.utils.watchdog): a rank that makes no progress writes the stacks
of all its threads and the node it is stuck in to output_dir/hang/rank_N.txt and ends with one line; SIGUSR1
writes the same file and the run goes on.

In-process cases drive the watchdog object with a tiny timeout (its exit replaced by a recorder); the job cases
run the default tiny job (one process) with a reward function that sleeps. A case that overruns its bound fails
with a message starting with HANG (scripts/reliability_report.py counts those as hangs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl.errors import VerlConfigError
from verl.utils.watchdog import HANG_EXIT_CODE, STUCK_FILE, Watchdog, rank_file

ROOT = Path(__file__).resolve().parents[2]


def _wait(cond, within: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < within, f"HANG: {what} not within {within} s"
        time.sleep(0.02)
    return time.monotonic() - start


def _sleeping_thread(name: str) -> threading.Event:
    release = threading.Event()

    def stuck_in_a_c_call():
        release.wait()
    threading.Thread(target=stuck_in_a_c_call, name=name, daemon=True).start()
    return release


# ---- the watchdog object -------------------------------------------------------------------------------------
def test_clear_watchdog_reports_a_silent_rank(tmp_path, capsys):
    exits: list[int] = []
    release = _sleeping_thread("reward-worker")
    wd = Watchdog(0.3, tmp_path, rank=0, world_size=1, exit=exits.append)
    try:
        with wd:
            wd.step = 7
            wd.on_node_start(SimpleNamespace(node="reward"))
            took = _wait(lambda: exits, 10, "the watchdog's expiry")
    finally:
        release.set()
    print(f"detected after {took:.2f} s (timeout 0.3 s)")
    assert exits == [HANG_EXIT_CODE]
    report = (tmp_path / rank_file(0)).read_text()
    head = report.splitlines()
    assert head[0].startswith("verl hang report: rank 0 of 1, pid ") and f"pid {os.getpid()}" in head[0], head[0]
    assert head[1].startswith("reason: no progress for") and "in node 'reward'" in head[1], head[1]
    assert head[2].startswith("last dataflow node entered: 'reward' (entered"), head[2]
    assert "step 7" in head[3], head[3]
    for thread in ("Thread MainThread", "Thread reward-worker", "Thread verl-hang-watchdog"):
        assert thread in report, report
    assert "in stuck_in_a_c_call" in report and "release.wait()" in report, report
    line = wd.expired
    assert line.startswith("[rank 0] no progress for ") and " s in node 'reward' (trainer.hang_timeout_s=0.3); " \
        f"stacks of every thread in {tmp_path / rank_file(0)}" in line, line
    err = capsys.readouterr().err
    assert err.count("verl: error:") == 1 and f"verl: error: {line}" in err, err
    assert not list((tmp_path / "hang").glob(".*.tmp")), "the temporary file was left behind"


def test_behaves_watchdog_stays_quiet_while_beats_come(tmp_path):
    exits: list[int] = []
    with Watchdog(0.2, tmp_path, exit=exits.append) as wd:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            wd.on_node_start(SimpleNamespace(node="generate"))
            time.sleep(0.03)
            with wd.phase("a checkpoint save"):
                time.sleep(0.03)
        thread = wd._thread
    assert exits == [] and not (tmp_path / "hang").exists()
    assert not thread.is_alive(), "stop() left the watchdog thread running"


def test_behaves_every_rank_writes_its_stacks(tmp_path, capsys):
    # Both ranks go silent, rank 0 first: it waits in the runtime after 'reward' while rank 1 is stuck inside it.
    # The rank inside the node is named (in stuck.txt and the one line); rank 0 writes its stacks on that cue
    # and exits without a line.
    exits: dict[int, list[int]] = {0: [], 1: []}
    wds = [Watchdog(0.4, tmp_path, rank=r, world_size=2, exit=exits[r].append) for r in (0, 1)]
    for wd in wds:
        wd.start()
    try:
        wds[0].on_node_end(SimpleNamespace(node="reward"))
        time.sleep(0.1)
        wds[1].on_node_start(SimpleNamespace(node="reward"))
        _wait(lambda: exits[0] and exits[1], 10, "both ranks' exits")
    finally:
        for wd in wds:
            wd.stop()
    assert exits == {0: [HANG_EXIT_CODE], 1: [HANG_EXIT_CODE]}
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("verl: error:")]
    assert len(errors) == 1 and errors[0].startswith("verl: error: [rank 1] no progress"), errors
    stuck = (tmp_path / STUCK_FILE).read_text()
    assert stuck.startswith("[rank 1] no progress for") and "in node 'reward'" in stuck, stuck
    mine = (tmp_path / rank_file(0)).read_text()
    assert "reason: another rank stopped the job: [rank 1] no progress" in mine, mine
    assert "after node 'reward'" in mine and "in node 'reward'" in (tmp_path / rank_file(1)).read_text()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_behaves_sigusr1_writes_stacks_and_the_run_goes_on(tmp_path, capsys):
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    exits: list[int] = []
    with Watchdog(0, tmp_path, rank=3, world_size=4, exit=exits.append) as wd:  # 0: no expiry, SIGUSR1 only
        wd.on_node_start(SimpleNamespace(node="update_actor"))
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: (tmp_path / rank_file(3)).exists(), 10, "the SIGUSR1 report")
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL, "the handler was not removed"
    report = (tmp_path / rank_file(3)).read_text()
    assert "reason: SIGUSR1 (on request; the run goes on)" in report and "'update_actor'" in report, report
    assert "Thread MainThread" in report and "test_behaves_sigusr1_writes_stacks" in report, report
    assert exits == []
    assert f"verl: [rank 3] SIGUSR1: stacks of every thread in {tmp_path / rank_file(3)}" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_behaves_sigusr1_of_the_application_is_left_alone(tmp_path):
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    try:
        with Watchdog(0, tmp_path):
            os.kill(os.getpid(), signal.SIGUSR1)
            _wait(lambda: got, 5, "the application's handler")
            time.sleep(0.2)
        assert not (tmp_path / "hang").exists()
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e12", "never"])
def test_clear_bad_hang_timeout(value):
    from verl.config import PPOConfig, load_config
    with pytest.raises(VerlConfigError) as info:
        load_config(PPOConfig, None, [f"trainer.hang_timeout_s={value}"])
    assert "trainer.hang_timeout_s" in str(info.value), str(info.value)


def test_behaves_hang_timeout_default_exceeds_the_other_timeouts():
    from verl.config import PPOConfig
    t = PPOConfig().trainer
    assert t.hang_timeout_s > t.node_timeout_s + t.collective_timeout_s


def test_behaves_hang_reports_are_the_runs_own_outputs(tmp_path):
    # Recorded in verl_run.json before any rank may write them: overwrite deletes an earlier run's reports and
    # keeps a file of someone else's in hang/, with a warning.
    from tests.trainer.conftest import TINY
    from verl.trainer.main_ppo import main
    out = tmp_path / "out"
    job = [*TINY, "warmup.steps=0", "trainer.total_steps=1", "trainer.save_final=false", "trainer.export_hf=false",
           "trainer.plot=false", f"trainer.output_dir={out}"]
    main(job)
    entries = json.loads((out / "verl_run.json").read_text())["entries"]
    assert entries["hang"] == "dir" and entries[rank_file(0)] == "file" and entries[STUCK_FILE] == "file"
    Watchdog(1.0, out).dump("as if the run had hung")
    (out / "hang" / "their_notes.txt").write_text("not verl's")
    with pytest.warns(UserWarning, match=r"kept .*hang: it holds files no verl run recorded \(their_notes.txt\)"):
        main([*job, "trainer.overwrite=true"])
    assert not (out / rank_file(0)).exists() and (out / "hang" / "their_notes.txt").read_text() == "not verl's"


# ---- the default job, one process ----------------------------------------------------------------------------
REWARD = '''
import os, time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    marker = Path(os.environ["HANG_TEST_DIR"]) / "in_reward"
    if os.environ.get("RANK", "0") == os.environ["HANG_TEST_RANK"] and not marker.exists():
        marker.write_text(str(time.time()))
        time.sleep(float(os.environ["HANG_TEST_SLEEP"]))
    return 0.0
'''


def _job(tmp_path: Path, sleep_s: float, *overrides: str, nproc: int = 1) -> tuple[subprocess.Popen, Path]:
    """The default job, its reward sleeping `sleep_s` on its first call on the last rank (torchrun when nproc > 1)."""
    reward = tmp_path / "sleepy_reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "HANG_TEST_DIR": str(tmp_path), "HANG_TEST_SLEEP": str(sleep_s), "HANG_TEST_RANK": str(nproc - 1)}
    env.pop("VERL_TRACEBACK", None)
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launcher, "-m", "verl.trainer.main_ppo", "warmup.steps=0", "trainer.total_steps=2",
           "val.num_examples=0", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
           "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.output_dir={out}",
           f"reward.name={reward}:compute_score", *overrides]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def _wait_marker(tmp_path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not (tmp_path / "in_reward").exists():
        if proc.poll() is not None:
            pytest.fail(f"the job ended before its reward ran (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("HANG: the job never reached its reward")
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_clear_hanging_reward_ends_the_job_with_stacks(tmp_path):
    hang_s = 3.0
    proc, out = _job(tmp_path, 10_000, f"trainer.hang_timeout_s={hang_s:g}", "trainer.node_timeout_s=600",
                     "trainer.collective_timeout_s=600")
    _wait_marker(tmp_path, proc)
    entered = float((tmp_path / "in_reward").read_text())
    try:
        _, err = proc.communicate(timeout=hang_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("HANG: the job was still running 60 s past trainer.hang_timeout_s")
    took = time.time() - entered
    print(f"hang detected and process ended {took:.2f} s after the reward began sleeping "
          f"(trainer.hang_timeout_s={hang_s:g})")
    assert proc.returncode == HANG_EXIT_CODE, (proc.returncode, err[-3000:])
    errors = [ln for ln in err.splitlines() if ln.startswith("verl: error:")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("verl: error: [rank 0] no progress for ") and "in node 'reward'" in errors[0] \
        and f"(trainer.hang_timeout_s={hang_s:g}); stacks of every thread in {out / rank_file(0)}" in errors[0], \
        errors[0]
    assert "Traceback" not in err, err[-3000:]
    report = (out / rank_file(0)).read_text()
    assert "last dataflow node entered: 'reward'" in report, report[:2000]
    assert "in compute_score" in report and "time.sleep(float(os.environ" in report, report
    assert "Thread MainThread" in report and "in fit" in report, report
    entries = json.loads((out / "verl_run.json").read_text())["entries"]
    assert entries.get("hang") == "dir" and entries.get(rank_file(0)) == "file", entries


@pytest.mark.multiprocess
def test_clear_two_ranks_under_torchrun_name_the_stuck_one(tmp_path):
    # Rank 1 sleeps in its reward; rank 0 waits for it in the runtime. Both write their stacks, one line names
    # rank 1 and the node, both exit with the watchdog's code.
    hang_s = 3.0
    proc, out = _job(tmp_path, 10_000, f"trainer.hang_timeout_s={hang_s:g}", "trainer.node_timeout_s=600",
                     "trainer.collective_timeout_s=600", nproc=2)
    _wait_marker(tmp_path, proc)
    entered = float((tmp_path / "in_reward").read_text())
    try:
        _, err = proc.communicate(timeout=hang_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("HANG: the job was still running 60 s past trainer.hang_timeout_s")
    print(f"2 ranks: the job ended {time.time() - entered:.2f} s after rank 1's reward began sleeping")
    errors = [ln for ln in err.splitlines() if ln.startswith("verl: error:")]
    assert len(errors) == 1 and errors[0].startswith("verl: error: [rank 1] no progress for ") \
        and "in node 'reward'" in errors[0], err[-4000:]
    # rank 1 ends with the watchdog's code; rank 0 too, unless torchrun's SIGTERM (sent when rank 1 ended) reaches
    # it between writing its stacks and its own exit
    assert proc.returncode != 0 and err.count(f"exitcode  : {HANG_EXIT_CODE}") >= 1, err[-4000:]
    assert "in compute_score" in (out / rank_file(1)).read_text()
    assert "another rank stopped the job: [rank 1]" in (out / rank_file(0)).read_text()


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_behaves_sigusr1_on_a_running_job_writes_stacks_and_it_finishes(tmp_path):
    proc, out = _job(tmp_path, 3)
    _wait_marker(tmp_path, proc)
    proc.send_signal(signal.SIGUSR1)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("HANG: the job did not finish after SIGUSR1")
    assert proc.returncode == 0, err[-3000:]
    report = (out / rank_file(0)).read_text()
    assert "reason: SIGUSR1 (on request; the run goes on)" in report, report[:2000]
    assert "in compute_score" in report and "last dataflow node entered: 'reward'" in report, report
    assert f"verl: [rank 0] SIGUSR1: stacks of every thread in {out / rank_file(0)}" in err, err[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2], rows
