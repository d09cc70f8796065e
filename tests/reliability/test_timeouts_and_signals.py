"""Hangs, exits, interrupts and dead ranks: every one ends, on every rank, with an error that names the node, the
rank and the time, within a bound; nothing waits forever.

Single-process cases check the node timeout against each way a node can hang; multi-process cases (gloo ranks,
plain processes and torchrun) check that the other ranks learn of a failure, a kill or a Ctrl-C in seconds.
A case that overruns its bound fails with a message starting with HANG (scripts/reliability_report.py counts
those as hangs).
"""

from __future__ import annotations

import math
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from verl import DataflowNode, build_dataflow
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "reliability" / "_fault_job.py"
TIMEOUT = 0.5


def _forever_busy():
    while True:
        pass


def _forever_sleep():
    time.sleep(1000)


def _forever_event():
    threading.Event().wait()


def _forever_queue():
    queue.Queue().get()


def _forever_lock():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def _forever_socket():
    a, b = socket.socketpair()
    try:
        a.recv(1)
    finally:
        a.close()
        b.close()


def _forever_subprocess():
    subprocess.run(["sleep", "1000"], check=False)


def _forever_select():
    r, w = os.pipe()
    try:
        select.select([r], [], [])
    finally:
        os.close(r)
        os.close(w)


def _forever_swallowing_exceptions():
    while True:
        try:
            time.sleep(1000)
        except Exception:  # noqa: BLE001 - the node's own handler must not swallow the timeout
            pass


def _forever_swallowing_the_first_interrupt():
    try:
        time.sleep(1000)
    except BaseException:  # noqa: BLE001 - swallows the first interrupt; the timer fires again
        time.sleep(1000)


def _forever_torch_ops():
    a = torch.randn(64, 64)
    while True:
        a = torch.tanh(a @ a)


HANGS = {f.__name__[len("_forever_"):]: f for f in (
    _forever_busy, _forever_sleep, _forever_event, _forever_queue, _forever_lock, _forever_socket,
    _forever_subprocess, _forever_select, _forever_swallowing_exceptions, _forever_swallowing_the_first_interrupt,
    _forever_torch_ops)}


def _hanging_flow(body, timeout_s=TIMEOUT, **cfg):
    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def hang(x):
        body()
        return x

    @DataflowNode(input_keys=["y"], output_keys=["z"])
    def after(y):
        raise AssertionError("the node after a timed-out node must not run")

    return build_dataflow(nodes=[hang, after], configs={"hang": {"timeout_s": timeout_s, **cfg}})


def _expect_timeout(df, bound_s, **run_kw):
    start = time.monotonic()
    with pytest.raises(VerlRuntimeError) as info:
        df.run({"x": 1}, **run_kw)
    took = time.monotonic() - start
    msg = str(info.value)
    assert took < bound_s, f"HANG: the node ran {took:.1f} s past a {TIMEOUT} s timeout"
    assert "node 'hang'" in msg and "rank 0" in msg and f"timeout_s={TIMEOUT:g}" in msg, msg
    assert "stopped after" in msg and " s)" in msg, msg
    assert info.value.node == "hang" and info.value.rank == 0
    return msg


@pytest.fixture
def alarm_state():
    """The SIGALRM handler and timer are the same after the test as before it."""
    before = signal.getsignal(signal.SIGALRM)
    yield
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


@pytest.mark.parametrize("how", list(HANGS))
def test_clear_node_timeout_stops_a_hanging_node(how, alarm_state):
    _expect_timeout(_hanging_flow(HANGS[how]), bound_s=TIMEOUT + 4)


@pytest.mark.parametrize("how", ["busy", "torch_ops", "swallowing_exceptions"])
def test_clear_node_timeout_in_a_worker_thread(how):
    # Outside the main thread there is no SIGALRM: the runtime sets an asynchronous exception on the thread.
    def slices():  # a thread can be interrupted between bytecodes only, so the sleep is cut into slices
        while True:
            time.sleep(0.01)
    body = slices if how == "swallowing_exceptions" else HANGS[how]
    out: dict = {}

    def target():
        try:
            _expect_timeout(_hanging_flow(body), bound_s=TIMEOUT + 4)
            out["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported to the test's thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TIMEOUT + 10)
    assert not t.is_alive(), "HANG: the worker thread's node was never interrupted"
    assert out.get("ok"), out.get("error")


def test_clear_timeout_covers_retries(alarm_state):
    from verl.dataflow import TransientError

    def flaky():
        raise TransientError("engine busy")
    _expect_timeout(_hanging_flow(flaky, retries=1000, retry_backoff_s=0.2), bound_s=TIMEOUT + 4)


def test_clear_timeout_with_hooks_and_trace(tmp_path, alarm_state):
    trace = tmp_path / "trace.json"
    _expect_timeout(_hanging_flow(_forever_sleep), bound_s=TIMEOUT + 4, trace=str(trace))
    assert trace.exists() and "hang" in trace.read_text()


def test_clear_timeout_in_a_run_after_an_earlier_good_run(alarm_state):
    done = []

    def sometimes():
        if done:
            _forever_sleep()
        done.append(1)
    df = _hanging_flow(sometimes)
    with pytest.raises(VerlRuntimeError, match="must not run"):  # the first run gets past 'hang'
        df.run({"x": 1})
    _expect_timeout(df, bound_s=TIMEOUT + 4)


def test_behaves_fast_timed_nodes_leave_no_stray_alarm(alarm_state):
    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def quick(x):
        return x + 1

    df = build_dataflow(nodes=[quick], configs={"quick": {"timeout_s": 0.05}})
    for i in range(200):
        assert df.run({"x": i})["y"] == i + 1
    time.sleep(1.2)  # a timer left armed (or re-firing) would raise here


def test_behaves_a_users_alarm_handler_and_timer_survive(alarm_state):
    fired = []
    old = signal.signal(signal.SIGALRM, lambda s, f: fired.append(s))
    try:
        _expect_timeout(_hanging_flow(_forever_busy), bound_s=TIMEOUT + 4)
        assert signal.getsignal(signal.SIGALRM) is not old  # ours, restored after the node
        # A user's own armed timer: the runtime leaves it alone and times the node from a thread instead.
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        _expect_timeout(_hanging_flow(_forever_busy), bound_s=TIMEOUT + 4)
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 20
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, old)
    assert fired == []


def test_behaves_thread_timer_never_fires_after_the_node():
    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def quick(x):
        return x + 1

    df = build_dataflow(nodes=[quick], configs={"quick": {"timeout_s": 0.02}})
    errors = []

    def target():
        try:
            for i in range(100):
                df.run({"x": i})
            end = time.monotonic() + 0.5
            while time.monotonic() < end:  # bytecodes where a late asynchronous exception would land
                pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(30)
    assert not t.is_alive() and errors == []


@pytest.mark.parametrize("code, shown", [(3, "sys.exit(3)"), ("bye", "sys.exit('bye')"), (None, "sys.exit(None)")])
def test_clear_sys_exit_in_a_node(code, shown):
    def leave():
        sys.exit(code)
    with pytest.raises(VerlRuntimeError) as info:
        _hanging_flow(leave, timeout_s=0).run({"x": 1})
    msg = str(info.value)
    assert "node 'hang'" in msg and "rank 0" in msg and shown in msg and "SystemExit" in msg, msg
    assert isinstance(info.value.__cause__, SystemExit)


def test_behaves_keyboard_interrupt_stops_the_run_and_the_flow_runs_again():
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    df = _hanging_flow(interrupted, timeout_s=0)
    with pytest.raises(KeyboardInterrupt):
        df.run({"x": 1})
    with pytest.raises(VerlRuntimeError, match="must not run"):  # a fresh run reaches the next node again
        df.run({"x": 1})


class _InterruptedOnSetName:
    def __set_name__(self, owner, name):
        raise KeyboardInterrupt


def test_behaves_ctrl_c_wrapped_by_python_is_still_an_interrupt(capsys):
    """Python 3.11 turns an exception raised in a class body's ``__set_name__`` (a dataclass field's, when Ctrl-C
    lands while a node imports a module) into a RuntimeError chained to it; CI saw that exit 1 instead of 130.
    The node still stops the run as an interrupt, and `verl train` still prints one line and exits 130."""
    def define_a_class():
        type("Late", (), {"field": _InterruptedOnSetName()})

    with pytest.raises(RuntimeError) as wrapped:
        define_a_class()
    assert isinstance(wrapped.value.__cause__ or wrapped.value.__context__, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        _hanging_flow(define_a_class, timeout_s=0).run({"x": 1})

    from verl.errors import run_cli

    def main(argv):
        define_a_class()
    assert run_cli(main, [], prog="verl train") == 130
    err = capsys.readouterr().err
    assert "verl train: interrupted (Ctrl-C / SIGINT)" in err and "Traceback" not in err, err


def test_behaves_ctrl_c_interrupts_a_sleeping_node():
    import _thread
    # Python's own SIGINT handler, whatever an earlier test or library left installed: interrupt_main only
    # reaches a handler Python owns, and the test is about what the runtime does with the KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    flow = _hanging_flow(lambda: [time.sleep(0.05) for _ in range(1000)], timeout_s=0)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            # interrupt_main trips the flag without a real signal, so the node's sleep is sliced
            flow.run({"x": 1})
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 5, "HANG: Ctrl-C did not stop the node"


# ---- configuration of the timeouts ------------------------------------------------------------------------
TRAINER_CASES = [("trainer.node_timeout_s", v) for v in ("-1", "nan", "inf", "soon")] + \
    [("trainer.collective_timeout_s", v) for v in ("inf", "-5", "1e12", "never")]


@pytest.mark.parametrize("key, value", TRAINER_CASES, ids=[f"{k}={v}" for k, v in TRAINER_CASES])
def test_clear_bad_trainer_timeout(key, value):
    from verl.config import PPOConfig, load_config
    with pytest.raises(VerlConfigError) as info:
        load_config(PPOConfig, None, [f"{key}={value}"])
    assert key in str(info.value), str(info.value)


def test_behaves_timeouts_default_and_reach_every_ppo_node():
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_flow import node_configs
    cfg = load_config(PPOConfig, None, [])
    assert cfg.trainer.collective_timeout_s == 600 and cfg.trainer.node_timeout_s == 3600  # finite by default
    assert all(c.timeout_s == 3600 for c in node_configs(cfg, cfg.roles(1)).values())
    cfg = load_config(PPOConfig, None, ["trainer.node_timeout_s=0"])  # off on request
    assert all(c.timeout_s == 0 for c in node_configs(cfg, cfg.roles(1)).values())
    cfg = load_config(PPOConfig, None, ["trainer.node_timeout_s=900"])
    nodes = node_configs(cfg, cfg.roles(1))
    assert nodes and all(c.timeout_s == 900 for c in nodes.values())


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "600"])
def test_clear_bad_collective_timeout_for_init_placement(value):
    from verl.distributed import init_placement
    with pytest.raises(VerlConfigError, match="trainer.collective_timeout_s"):
        init_placement("cpu", timeout_s=value)


# ---- several ranks ------------------------------------------------------------------------------------------
def _group_timeouts(rank, world):
    from verl.dataflow import comm
    from verl.distributed import collective_timeout, init_placement, new_group
    inherited = collective_timeout().total_seconds()  # no init_placement yet: the default group's own
    init_placement("cpu", timeout_s=7)
    made = [comm.group_for((0,)), comm.control_group((0, 1)), new_group([0, 1]), new_group([1])]
    secs = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in made
            if g is not None and g != torch.distributed.GroupMember.NON_GROUP_MEMBER]
    return inherited, secs


@pytest.mark.multiprocess
def test_behaves_every_group_gets_the_job_timeout():
    for inherited, secs in run_distributed(_group_timeouts, world_size=2, timeout=60):
        assert inherited == pytest.approx(48.0) and secs and all(s == 7.0 for s in secs), (inherited, secs)


def _megatron_group_timeouts(rank, world):
    from megatron.core import parallel_state as ps

    from verl.distributed import destroy_process_groups, init_placement
    init_placement("cpu", megatron=True, timeout_s=9)
    groups = [ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group(), ps.get_model_parallel_group()]
    secs = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
    destroy_process_groups()
    return secs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_behaves_megatron_groups_get_the_job_timeout():
    for secs in run_distributed(_megatron_group_timeouts, world_size=2, timeout=120):
        assert secs == [9.0, 9.0, 9.0]


def _failing_rank(rank, world, scenario):
    from verl.distributed import init_placement, new_group
    init_placement("cpu", timeout_s=4)  # the groups made from here on (the dataflow's, `pair`) time out at 4 s
    pair = new_group([0, 1])

    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def step(x, ctx):
        if rank == 1 and scenario == "timeout":
            _forever_busy()
        if rank == 1 and scenario == "exit":
            sys.exit(4)
        if scenario == "stuck_in_collective":
            if rank == 1:
                _forever_busy()
            torch.distributed.all_reduce(torch.ones(1), group=pair)
        return x + 1

    @DataflowNode(input_keys=["y"], output_keys=["z"])
    def after(y):
        return y

    df = build_dataflow(nodes=[step, after], configs={"step": {"timeout_s": 1.0 if scenario != "exit" else 0}})
    start = time.monotonic()
    try:
        df.run({"x": torch.zeros(2)})
    except VerlRuntimeError as e:
        return str(e), e.node, e.rank, time.monotonic() - start
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario, parts", [
    ("timeout", ["failed", "exceeded its timeout_s=1", "stopped after 1."]),
    ("exit", ["failed", "sys.exit(4)"]),
])
def test_clear_failure_on_one_rank_reaches_every_rank(scenario, parts):
    results = run_distributed(_failing_rank, world_size=2, args=(scenario,), timeout=60)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} finished without an error"
        msg, node, frank, took = res
        assert node == "step" and frank == 1, msg
        assert all(p in msg for p in parts), msg
        assert took < 15, f"HANG: rank {rank} took {took:.1f} s to learn of rank 1's failure"
    assert "(rank 0 stopped its run)" in results[0][0]


@pytest.mark.multiprocess
def test_clear_rank_stuck_in_a_collective_ends_at_the_collective_timeout():
    # Rank 1 loops (interrupted at 1 s); rank 0 waits for it in an all_reduce inside the node, which only the
    # collective timeout (4 s) ends, while rank 1 waits in the agreement. Both then agree and name the timeouts.
    results = run_distributed(_failing_rank, world_size=2, args=("stuck_in_collective",), timeout=40)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} finished without an error"
        msg, node, frank, took = res
        assert node == "step" and "exceeded its timeout_s=1" in msg, msg
        assert "rank 1" in msg and took < 15, (took, msg)


# ---- separate processes: kills, hangs, signals ---------------------------------------------------------------
def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("VERL_TRACEBACK", None)
    return env


def _spawn_ranks(scenario: str, out: Path, collective_timeout: float = 3.0) -> list[subprocess.Popen]:
    from verl.distributed.placement import free_port
    port = free_port()
    return [subprocess.Popen([sys.executable, str(JOB), scenario, str(out), str(collective_timeout)],
                             env={**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                                  "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def _finish(procs: list[subprocess.Popen], within: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + within
    outs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"HANG: a rank was still running {within:.0f} s after the fault")
        outs.append((p.returncode, err))
    return outs


def _wait_ready(out: Path, ranks=(0, 1), within: float = 90.0) -> list[int]:
    deadline = time.monotonic() + within
    while not all((out / f"ready_{r}").exists() for r in ranks):
        assert time.monotonic() < deadline, "the job never reached its node"
        time.sleep(0.05)
    time.sleep(0.2)
    return [int((out / f"ready_{r}").read_text()) for r in ranks]


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["kill", "kill_after"])
def test_clear_rank_killed_mid_step(tmp_path, scenario):
    procs = _spawn_ranks(scenario, tmp_path)
    _wait_ready(tmp_path)
    start = time.monotonic()
    (code0, err0), (code1, _) = _finish(procs, within=20)
    assert code1 == -signal.SIGKILL
    assert code0 == 1 and "Traceback" not in err0, err0
    assert "lost contact with ranks [1]" in err0 and "a rank died" in err0, err0
    assert time.monotonic() - start < 15
    if scenario == "kill":  # rank 0 failed inside the node first (its all_reduce lost its peer)
        assert "[node 'step', rank 0] failed: RuntimeError" in err0, err0


@pytest.mark.multiprocess
def test_clear_rank_hanging_past_the_collective_timeout(tmp_path):
    procs = _spawn_ranks("hang", tmp_path, collective_timeout=3.0)
    _wait_ready(tmp_path)
    (code0, err0), (code1, err1) = _finish(procs, within=30)
    assert code0 == 1 and "rank 0 lost contact with ranks [1]" in err0 and "(3 s, " in err0, err0
    assert "Timed out" in err0 or "timed out" in err0, err0
    assert code1 == 1 and "lost contact" in err1, err1


@pytest.mark.multiprocess
def test_clear_ctrl_c_on_one_rank_of_plain_processes(tmp_path):
    # bounds far from the collective timeout but loose enough for a machine loaded by other jobs
    procs = _spawn_ranks("spin1", tmp_path, collective_timeout=180.0)
    pids = _wait_ready(tmp_path, ranks=(1,))
    time.sleep(0.5)  # rank 0 has left the node and waits in the agreement
    os.kill(pids[0], signal.SIGINT)
    start = time.monotonic()
    (code0, err0), (code1, err1) = _finish(procs, within=45)
    assert code1 == 130 and "interrupted" in err1 and "Traceback" not in err1, err1
    assert code0 == 1 and "lost contact with ranks [1]" in err0 and "interrupted" in err0, err0
    assert time.monotonic() - start < 40  # far below the 180 s collective timeout


def _torchrun(scenario: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--monitor-interval=0.1", str(JOB), scenario, str(out), "60"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["launcher", "process_group", "one_rank"])
def test_behaves_ctrl_c_under_torchrun_ends_every_rank(tmp_path, target):
    launcher = _torchrun("spin", tmp_path)
    try:
        pids = _wait_ready(tmp_path)
        start = time.monotonic()
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGINT)
        elif target == "process_group":  # what Ctrl-C in a terminal does
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            os.kill(pids[1], signal.SIGINT)
        try:
            _, err = launcher.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("HANG: torchrun still running 20 s after Ctrl-C")
        took = time.monotonic() - start
        while not all(_gone(p) for p in pids) and time.monotonic() - start < 20:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), "HANG: a rank outlived its launcher"
        assert launcher.returncode != 0 and took < 10, (launcher.returncode, took)
        assert "fault_job: interrupted (Ctrl-C / SIGINT)" in err, err[-2000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.multiprocess
def test_behaves_rank_killed_under_torchrun_ends_the_job(tmp_path):
    launcher = _torchrun("kill_after", tmp_path)
    try:
        pids = _wait_ready(tmp_path)
        try:
            launcher.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("HANG: torchrun still running 20 s after a rank was killed")
        assert launcher.returncode != 0 and all(_gone(p) for p in pids)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.slow
def test_behaves_verl_train_ctrl_c_exits_with_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "verl.cli.main", "train", f"trainer.output_dir={tmp_path}",
                             "trainer.progress_bar=false", "warmup.steps=0", "trainer.total_steps=10000"],
                            env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never logged a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("HANG: verl train still running 60 s after Ctrl-C")
        assert proc.returncode == 130 and time.monotonic() - start < 45, (proc.returncode, err[-2000:])
        assert "verl train: interrupted (Ctrl-C / SIGINT)" in err and "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["process_group", "rollout_rank"])
def test_behaves_ctrl_c_in_async_mode_ends_both_stages(tmp_path, target):
    """trainer.mode=async: the rollout's rank streams on its own, so neither side meets the other in a collective
    each step; Ctrl-C (the terminal's, or on the rollout's rank alone) must still end every rank, far below the
    collective timeout."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=0.1",
         "-m", "verl.trainer.main_ppo", "trainer.mode=async", "algorithm.max_staleness=2", "trainer.placement=split",
         "actor.ranks=[0]", "rollout.ranks=[1]", "reward.ranks=[0]", "warmup.steps=0", "trainer.total_steps=100000",
         "trainer.progress_bar=false", "trainer.save_final=false", "trainer.collective_timeout_s=300",
         "val.num_examples=0", f"trainer.output_dir={tmp_path}"], env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, "the job never reached step 3"
            time.sleep(0.1)
        ranks = _children(launcher.pid)
        start = time.monotonic()
        if target == "process_group":
            os.killpg(launcher.pid, signal.SIGINT)
        else:  # rank 1 alone: the rollout's
            os.kill(next(p for p in ranks if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()),
                    signal.SIGINT)
        try:
            launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("HANG: torchrun still running 60 s after Ctrl-C in async mode")
        while not all(_gone(p) for p in ranks) and time.monotonic() - start < 60:
            time.sleep(0.05)
        assert all(_gone(p) for p in ranks), "HANG: a rank outlived its launcher"
        assert launcher.returncode != 0 and time.monotonic() - start < 60  # far below the 300 s timeout
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
