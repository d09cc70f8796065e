"""The hang watchdog: a rank that makes no progress for ``trainer.hang_timeout_s`` writes the Python stacks of all
its threads and the last dataflow node it entered to ``<output_dir>/hang/rank_N.txt``, prints one line and ends
with exit code `HANG_EXIT_CODE`; SIGUSR1 writes the same file on request and the run goes on.

Progress is a heartbeat: the dataflow runtime's hooks (`on_node_start` / `on_node_end`: the watchdog is one of
the hooks the trainer passes to ``flow.run``) and the trainer's phases (a step, validation, a checkpoint save, the
export) touch it. A daemon thread per rank checks it every `poll_s` seconds. The thread, not the main thread,
writes the file and ends the process with ``os._exit``, so a main thread blocked inside a collective or any C call
that releases the GIL (torch ops, NCCL, gloo, sleeps and socket reads do) is no obstacle.

Every rank of the job: the first rank whose heartbeat expires creates ``hang/stuck.txt`` (its one line; created
exclusively, so it names the first), prints that line and gives the others up to `PEER_GRACE_S` to write their own
stacks before it exits; a rank that sees the file writes its stacks and exits too, without a line. A rank waiting
between nodes expires `PEER_GRACE_S` later than one stuck inside a node, so that the one inside is named; a rank
expiring after the first exits without a line. That needs ``output_dir`` on a filesystem every rank sees, as
checkpoints do.

Limits: a C call that holds the GIL forever also stops the watchdog thread (nothing in Python can then run); the
SIGUSR1 handler runs in the main thread, so a main thread blocked inside a C call answers when the call returns
(it is the expiry, not the signal, that does not need the main thread).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["HANG_EXIT_CODE", "HANG_DIR", "STUCK_FILE", "Watchdog", "rank_file", "stacks"]

HANG_EXIT_CODE = 124
"""Exit code of a process the watchdog ended (as GNU timeout's: distinct from verl's 1 = error, 2 = config error,
130 = Ctrl-C)."""
HANG_DIR = "hang"
"""The reports' folder under output_dir."""
STUCK_FILE = f"{HANG_DIR}/stuck.txt"
"""The first expired rank's one line: the other ranks' cue to write their stacks."""
PEER_GRACE_S = 2.0
"""How long an expired rank waits for the other ranks' files before it exits."""


def rank_file(rank: int) -> str:
    """The report of rank `rank`, relative to output_dir."""
    return f"{HANG_DIR}/rank_{rank}.txt"


def stacks() -> str:
    """The Python stack of every thread of this process, innermost call last, each headed by the thread's name."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != threading.main_thread().ident):
        t = threads.get(ident)
        name = t.name if t is not None else "(not a threading.Thread)"
        flags = ", ".join(f for f, on in (("main", t is threading.main_thread()), ("daemon", t is not None
                                                                                  and t.daemon)) if on)
        out.append(f"Thread {name} (ident {ident}{', ' + flags if flags else ''}), most recent call last:")
        out.append("".join(traceback.format_stack(frame)).rstrip("\n"))
        out.append("")
    return "\n".join(out)


class Watchdog:
    """One rank's hang watchdog (see the module docstring). ``with Watchdog(...):`` starts and stops it; the
    dataflow runtime calls its hooks, the trainer its `beat` / `phase`. `timeout_s=0`: SIGUSR1 only."""

    def __init__(self, timeout_s: float, out_dir: str | Path, rank: int = 0, world_size: int = 1, *,
                 setting: str = "trainer.hang_timeout_s", exit: Callable[[int], Any] = os._exit):
        self.timeout_s, self.out_dir, self.rank, self.world_size = timeout_s, Path(out_dir), rank, world_size
        self.setting, self._exit = setting, exit
        self.poll_s = min(1.0, max(0.05, timeout_s / 10)) if timeout_s > 0 else 1.0
        self.last = time.monotonic()
        self.where = "before the first step"
        self.inside = False  # inside a node or phase (a rank stuck there is the likely culprit)
        self.node: str | None = None  # the last dataflow node entered
        self.node_since = 0.0
        self.step: int | None = None
        self.expired: str | None = None  # the one line, once the heartbeat expired
        self._wake, self._requested, self._stopped = threading.Event(), False, False
        self._thread: threading.Thread | None = None
        self._old_usr1: Any = None

    # -- the heartbeat ---------------------------------------------------------------------------------------
    def beat(self, where: str, inside: bool = False) -> None:
        """Progress: the rank is now `where` (shown if it stays there past the timeout); `inside` a node or phase
        rather than between them, waiting for the other ranks."""
        self.where, self.inside = where, inside
        self.last = time.monotonic()

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Beats on entering and leaving `what` (a validation, a checkpoint save)."""
        self.beat(f"in {what}", inside=True)
        try:
            yield
        finally:
            self.beat(f"after {what}")

    def on_node_start(self, event) -> None:
        """Dataflow hook: entering a node."""
        self.node, self.node_since = event.node, time.monotonic()
        self.beat(f"in node '{event.node}'", inside=True)

    def on_node_end(self, event) -> None:
        """Dataflow hook: a node returned (or failed); the runtime moves data or agrees with the other ranks."""
        self.beat(f"after node '{event.node}' (in the dataflow runtime: moving data or waiting for other ranks)")

    # -- starting and stopping -------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Starts the thread and, in the main thread, answers SIGUSR1 (unless another handler is installed)."""
        self.beat(self.where, self.inside)
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1") \
                and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            self._old_usr1 = signal.signal(signal.SIGUSR1, self._on_usr1)
        self._thread = threading.Thread(target=self._watch, name="verl-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._old_usr1 is not None and signal.getsignal(signal.SIGUSR1) == self._on_usr1:
            signal.signal(signal.SIGUSR1, self._old_usr1)
        self._old_usr1 = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _on_usr1(self, signum, frame) -> None:
        # Only a flag: the thread writes the file (a handler that takes locks can deadlock the code it interrupts).
        self._requested = True
        self._wake.set()

    # -- the thread ------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stopped:
                return
            if self._requested:
                self._requested = False
                self._report("SIGUSR1 (on request; the run goes on)", note=True)
            if self.timeout_s <= 0:
                continue
            idle = time.monotonic() - self.last
            # a rank waiting between nodes gives one stuck inside a node the time to be named first
            if idle > self.timeout_s + (0.0 if self.inside or self.world_size == 1 else PEER_GRACE_S):
                self._expire(idle)
                return
            if self.world_size > 1 and self._answer_peer():
                return

    def _report(self, reason: str, note: bool = False) -> Path | None:
        try:
            path = self.dump(reason)
        except Exception as e:  # noqa: BLE001 - the watchdog must still end a stuck process
            print(f"verl: [rank {self.rank}] could not write the hang report: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return None
        if note:
            print(f"verl: [rank {self.rank}] {reason.split(' (')[0]}: stacks of every thread in {path}",
                  file=sys.stderr, flush=True)
        return path

    def _expire(self, idle: float) -> None:
        reason = f"no progress for {idle:.1f} s {self.where} ({self.setting}={self.timeout_s:g})"
        path = self._report(reason)
        shown = f"stacks of every thread in {path}" if path is not None else "its stacks could not be written"
        self.expired = f"[rank {self.rank}] {reason}; {shown}"
        first = self.world_size == 1 or self._claim_first()
        if first:  # the job's one line; a rank expiring after the first says nothing more (its file does)
            print(f"verl: error: {self.expired}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if first and self.world_size > 1:
            self._await_peers()
        self._exit(HANG_EXIT_CODE)

    def _claim_first(self) -> bool:
        """Creates hang/stuck.txt with this rank's line unless another rank did (False): the other ranks' cue."""
        try:
            fd = os.open(self.out_dir / STUCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError:  # no shared cue (a read-only or vanished folder): each rank reports for itself
            return True
        with os.fdopen(fd, "w") as f:
            f.write(self.expired + "\n")
        return True

    def _await_peers(self) -> None:
        """Up to PEER_GRACE_S: until every rank's file is newer than stuck.txt."""
        try:
            since = os.stat(self.out_dir / STUCK_FILE).st_mtime
        except OSError:
            return
        deadline = time.monotonic() + PEER_GRACE_S
        waiting = set(range(self.world_size)) - {self.rank}
        while waiting and time.monotonic() < deadline:
            for r in list(waiting):
                try:
                    if os.stat(self.out_dir / rank_file(r)).st_mtime >= since:
                        waiting.discard(r)
                except OSError:
                    pass
            time.sleep(0.05)

    def _answer_peer(self) -> bool:
        """On another rank's stuck.txt: writes this rank's stacks and ends the process quietly (the job is over:
        its peers would only fail next, naming the lost rank instead of the stuck one)."""
        try:
            line = (self.out_dir / STUCK_FILE).read_text().strip()
        except OSError:  # absent: nobody is stuck
            return False
        self._report(f"another rank stopped the job: {line}")
        sys.stdout.flush()
        self._exit(HANG_EXIT_CODE)
        return True

    def dump(self, reason: str) -> Path:
        """Writes this rank's report (header, then every thread's stack) to hang/rank_N.txt: to a temporary
        name first, then renamed over the earlier report, so a reader never sees half a file."""
        now = time.monotonic()
        node = f"'{self.node}' (entered {now - self.node_since:.1f} s ago)" if self.node else "none yet"
        head = [f"verl hang report: rank {self.rank} of {self.world_size}, pid {os.getpid()}, host "
                f"{socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M:%S')}",
                f"reason: {reason}",
                f"last dataflow node entered: {node}",
                f"where: {self.where} (last progress {now - self.last:.1f} s ago"
                + (f", step {self.step}" if self.step is not None else "") + ")",
                f"{self.setting}: {self.timeout_s:g}", "", ""]
        path = self.out_dir / rank_file(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            f.write("\n".join(head) + stacks())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path
