"""Run a function on N CPU ranks with gloo and collect each rank's result.

    from verl.testing import run_distributed

    def body(rank, world_size, scale):        # module-level, so that it pickles
        t = torch.full((2,), float(rank))
        torch.distributed.all_reduce(t)
        return t * scale

    results = run_distributed(body, world_size=2, args=(3.0,))   # [rank0_result, rank1_result]

The ranks are forked from a fork server that imported torch, transformers and megatron-core once for the whole
process (~5-10 s of imports a spawned rank would pay each time); each rank starts with the caller's current
environment, `sys.path` and stdout / stderr (pytest's capfd sees what ranks print), as a spawned one would.
VERL_TEST_SPAWN=1 spawns them instead.

The rendezvous store lives in the calling process for the whole run, not in rank 0: a rank still using the
store (a late `add`, a barrier of its own) never finds it gone because rank 0 returned and exited first, while
rank 0's exit still closes its connections to the other ranks at once (a peer waiting on a rank that failed
sees it right away).

A rank that raises makes `run_distributed` raise `RankFailure` naming the rank, with the rank's own
traceback in the message; the other ranks are then stopped instead of waiting in a collective. A run
that outlives `timeout` is killed and reported the same way (gloo would otherwise hang a healthy rank for
the process group's whole timeout when its peer dies). No `torch.testing._internal` here: it moves
between releases.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


class RankFailure(RuntimeError):
    """A rank of `run_distributed` raised, or the run timed out."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


# imported by the fork server before it forks any rank: the heavy, import-time-only part of a rank's start
PRELOAD = ["torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.parallel_state"]
_context = None


def _ranks_context(spawn: bool):
    """The fork server's context (started on first use, with PRELOAD imported), or spawn's (`spawn`, or
    VERL_TEST_SPAWN)."""
    global _context
    if spawn or os.environ.get("VERL_TEST_SPAWN"):
        return mp.get_context("spawn")
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class _Fd:
    """One of the caller's file descriptors, duplicated into a rank as it starts (pickled while the rank is
    launched, so the fd travels with it): a rank forked by the server does not inherit the caller's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: Sequence[Any], kwargs: dict,
            results: "mp.Queue", pg_timeout_s: float, threads: int, env: dict[str, str],
            stdio: tuple[int, int]) -> None:
    os.environ.clear()  # the caller's environment and stdout / stderr (a forked rank holds the fork server's)
    os.environ.update(env)
    for fd, target in zip(stdio, (1, 2)):
        if fd != target:  # (a spawned rank receives the caller's fd under the same number)
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)  # the caller hosts it
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        out = fn(rank, world_size, *args, **kwargs)
        try:
            payload = pickle.dumps(out)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"the result of rank {rank} cannot be pickled ({e}); return tensors, numbers, "
                            f"lists or dicts") from e
        results.put((rank, "ok", payload))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), kwargs: dict | None = None, *,
                    timeout: float = 120.0, threads: int = 1, env: dict[str, str] | None = None,
                    spawn: bool = False) -> list[Any]:
    """Runs `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks (`env`: variables set on top of
    the caller's environment there; `spawn`: each rank a new interpreter, finalized at its exit, which engines
    that clean up in destructors need: a forked rank ends in os._exit, and vLLM's CPU workers then leave their
    shared-memory segments in /dev/shm, whose fixed names the next engine fails to create).

    Returns the results ordered by rank. Raises `RankFailure` when a rank raises (the first failing rank's
    traceback is in the message) or when the whole run exceeds `timeout` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _ranks_context(spawn)
    results = ctx.Queue()
    # The process group's own timeout is shorter than ours, so a rank stuck in a collective whose peer died
    # errors out by itself; we still kill stragglers at `timeout`.
    pg_timeout = max(5.0, timeout * 0.8)
    # the rendezvous store, here until every rank is reaped (port 0: the system picks a free one)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=pg_timeout),
                          wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, port, tuple(args), dict(kwargs or {}), results, pg_timeout, threads,
                               {**os.environ, **(env or {})}, (_Fd(1), _Fd(2))))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failure: RankFailure | None = None
    try:
        outputs, failure = _collect(procs, results, world_size, time.monotonic() + timeout, fn, timeout)
    finally:
        _reap(procs, results, quick=failure is not None)
        del store
    if failure is not None:
        raise failure
    return [outputs[r] for r in range(world_size)]


def _collect(procs, results, world_size: int, deadline: float, fn, timeout: float):
    """Every rank's result, or the first failure (a rank's exception, a rank that died silently, the deadline)."""
    outputs: dict[int, Any] = {}
    while len(outputs) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            return outputs, RankFailure(f"run_distributed({getattr(fn, '__name__', fn)}) timed out after "
                                        f"{timeout:.0f}s; ranks {missing} did not finish")
        try:
            rank, status, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in outputs]
            if not dead:
                continue
            try:  # a rank died without reporting (segfault, os._exit): give its message a moment to arrive
                rank, status, payload = results.get(timeout=2.0)
            except queue.Empty:
                return outputs, RankFailure(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a "
                                            f"result", dead[0])
        if status != "ok":
            return outputs, RankFailure(f"rank {rank} of {world_size} failed: {payload}", rank)
        outputs[rank] = pickle.loads(payload)
    return outputs, None


def _reap(procs, results, quick: bool) -> None:
    """Joins the ranks (briefly after a failure), kills stragglers, closes the queue."""
    grace = time.monotonic() + (0.5 if quick else 5.0)
    for p in procs:
        p.join(timeout=max(0.0, grace - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    results.close()
