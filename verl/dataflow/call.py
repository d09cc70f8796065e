"""Calling one node on one rank: its inputs in, its declared outputs out (checked where they are made), with
cpu_offload around the call, retries of transient errors, and the node's time limit.

Timeouts: every node has a time limit (an hour unless its config says otherwise; 0 only on request). One
with ``timeout_s > 0`` still running after that long (retries, onload and offload included) is
interrupted. In the main thread the interrupt is SIGALRM (an interval timer, restored after the node), whose
handler raises `NodeTimeout` inside the node: it stops pure-Python loops at their next bytecode and wakes the
blocking calls Python retries after a signal (sleep, lock and queue waits, socket reads, subprocess waits). The
timer re-fires every second, so a node that swallows the interrupt (``except BaseException``) is interrupted
again. In another thread the interrupt is an asynchronous exception set on that thread, delivered at its next
bytecode. SIGALRM belongs to the runtime while a timed node runs in the main thread; a node that arms its own
ITIMER_REAL runs without the timer (the thread path is used instead). Python cannot unwind a thread blocked
inside native code: a node stuck in a collective or a C extension is interrupted only when that call returns.
"""

from __future__ import annotations

import ctypes
import difflib
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from verl.dataflow.node import NodeEntry, TransientError
from verl.dataflow.plan import Step

__all__ = ["NodeTimeout", "OutputError", "call", "describe"]


class NodeTimeout(BaseException):
    """Raised inside a node that ran past its ``timeout_s``. A BaseException, like KeyboardInterrupt, so that a
    node's own ``except Exception`` and the retry loop do not swallow it."""


class _Deadline:
    """Interrupts the code inside ``with`` after ``timeout_s`` seconds (see the module docstring)."""

    __slots__ = ("timeout_s", "start", "_old", "_timer", "_lock", "_done", "_tid")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._old: Any = None
        self._timer: threading.Timer | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __enter__(self) -> "_Deadline":
        self.start = time.monotonic()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer") \
                and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0):
            self._old = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s, 1.0)
        else:
            self._lock, self._done, self._tid = threading.Lock(), False, threading.get_ident()
            self._timer = threading.Timer(self.timeout_s, self._interrupt_thread)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _on_alarm(self, signum, frame) -> None:
        raise NodeTimeout(f"still running after {self.elapsed():.1f} s")

    def _interrupt_thread(self) -> None:
        with self._lock:
            if not self._done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(NodeTimeout))

    def __exit__(self, *exc) -> None:
        if self._timer is None:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, self._old if self._old is not None else signal.SIG_DFL)
            return
        self._timer.cancel()
        with self._lock:
            self._done = True
            # An interrupt set just as the node returned has not been delivered yet: withdraw it.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)


def describe(exc: BaseException, cfg: Any, elapsed: float) -> str:
    """The failure message of a node that raised ``exc`` after ``elapsed`` seconds."""
    if isinstance(exc, OutputError):
        return str(exc)
    if isinstance(exc, NodeTimeout):
        return (f"exceeded its timeout_s={cfg.timeout_s:g} (stopped after {elapsed:.1f} s); raise the node's "
                f"timeout_s or find what it waits for")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted (KeyboardInterrupt: Ctrl-C or SIGINT) after {elapsed:.1f} s"
    if isinstance(exc, SystemExit):
        return (f"called sys.exit({exc.code!r}) (SystemExit); a node must raise an exception, not exit the "
                f"process: the other ranks would wait for it")
    return f"{type(exc).__name__}: {exc}"


def _normalize(entry: NodeEntry, out: Any) -> tuple:
    node = entry.node
    keys = node.output_keys
    if node.returns_dict:
        if (type(out) is dict or isinstance(out, Mapping)) and len(out) == len(keys):
            try:
                return tuple([out[k] for k in keys])
            except KeyError:
                pass
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise OutputError(f"returned {got} but its outputs are {list(keys)} (read from its return statement); "
                           f"return a dict with exactly these keys, or declare @CustomNode(output_keys=[...])")
    n = len(keys)
    if n == 1:
        return (_one_output(keys[0], out),)
    if n == 0:
        if out is None or (isinstance(out, Mapping) and not out):
            return ()
        raise OutputError(f"declares no output_keys but returned {type(out).__name__}; return None or declare "
                           f"the outputs")
    if isinstance(out, Mapping):
        if len(out) == n and all(k in out for k in keys):
            return tuple(out[k] for k in keys)
        raise OutputError(f"returned a dict with keys {sorted(map(str, out))} but declares output_keys "
                           f"{list(keys)}; return exactly these keys")
    if isinstance(out, (tuple, list)) and len(out) == n:
        return tuple(out)
    got = f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
    raise OutputError(f"returned {got} but declares {n} output_keys {list(keys)}; return a tuple in that order "
                       f"or a dict keyed by them")

def _one_output(key: str, out: Any) -> Any:
    """The value of a one-output node: what it returned, checked here where it is made (a consumer would
    otherwise fail on it and be blamed). None is refused; so is a one-key dict whose key is a misspelling of
    the output, and a dict keyed by the output itself gives its value, as it would for several outputs."""
    if out is None:
        raise OutputError(f"returned None for its output '{key}'; return the value (a node that makes nothing "
                           f"declares no output_keys)")
    if isinstance(out, Mapping) and len(out) == 1:
        (got,) = out
        if got == key:
            return out[got]
        if isinstance(got, str) and _misspelt(got, key):
            raise OutputError(f"returned a dict with the one key {got!r}, close to its output '{key}'; return "
                               f"the value itself, {{'{key}': value}}, or, for a dict-valued output, "
                               f"{{'{key}': {{{got!r}: ...}}}}")
    return out


def _misspelt(a: str, b: str) -> bool:
    """`a` is one edit (insert, delete, replace) from `b`, ignoring case, or as close by difflib's ratio."""
    a, b = a.lower(), b.lower()
    if abs(len(a) - len(b)) <= 1:
        short, long_ = sorted((a, b), key=len)
        for i in range(len(long_)):
            if long_[:i] + long_[i + 1:] == short or (len(a) == len(b) >= 3 and a[:i] + b[i] + a[i + 1:] == b):
                return True
    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.8



class OutputError(Exception):
    """A node returned other outputs than it declared (never retried)."""


def _is_transient(e: BaseException, retry_on: tuple) -> bool:
    return isinstance(e, TransientError) or getattr(e, "transient", False) is True or \
        (bool(retry_on) and isinstance(e, retry_on))


def _movable(v: Any) -> bool:
    return isinstance(v, torch.nn.Module) or callable(getattr(v, "onload", None))


def _onload(objs: list, device: torch.device) -> None:
    for m in objs:
        if callable(getattr(m, "onload", None)):
            m.onload(device)
        else:
            m.to(device)


def _offload(objs: list) -> None:
    for m in objs:
        if callable(getattr(m, "offload", None)):
            m.offload()
        else:
            m.to("cpu")


def call(step: Step, args: list) -> tuple[tuple, int]:
    """Runs the node (with offload and retries); returns its outputs in declared order and the retry count."""
    cfg = step.entry.config
    if cfg.timeout_s > 0:
        with _Deadline(cfg.timeout_s):
            return _call_once(step, args)
    return _call_once(step, args)


def _call_once(step: Step, args: list) -> tuple[tuple, int]:
    cfg = step.entry.config
    ctx = step.ctx
    kwargs = dict(zip(step.arg_names, args)) if step.arg_names is not None else None
    moved = []
    if cfg.cpu_offload:
        moved = [a for a in args if _movable(a)] + list(ctx._offload)
        _onload(moved, ctx.device)
    try:
        attempt = 0
        while True:
            ctx.attempt = attempt
            try:
                if kwargs is not None:
                    if step.entry.node.wants_context:
                        kwargs["ctx"] = ctx
                    out = step.fn(**kwargs, **cfg.settings) if cfg.settings else step.fn(**kwargs)
                else:
                    extra = {"ctx": ctx} if step.entry.node.wants_context else {}
                    out = step.fn(*args, **extra, **cfg.settings)
                return _normalize(step.entry, out), attempt
            except OutputError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below, re-raised when not transient
                if attempt >= cfg.retries or not _is_transient(e, cfg.retry_on):
                    raise
                time.sleep(cfg.retry_backoff_s * (2 ** attempt))
                attempt += 1
    finally:
        if cfg.cpu_offload:  # also modules the node registered during this call
            _offload(moved + [m for m in ctx._offload if not any(m is x for x in moved)])
