"""A background sender: the main thread hands items over and goes on; one thread sends them, in order.

What both streaming paths share (a dataflow queue's values, `verl.dataflow.queue`; an async actor's weight
versions, `verl.workers.rollout.WeightStream`): handing over waits only for room, and keeps checking that the
sender is alive, because a sender whose peer died never frees the room. Its failure is raised in the main thread
at the next `hand` or `finish`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()


class Sender:
    """Calls `send(item)` on a daemon thread for each item handed over, in order, with up to `room` items
    waiting. `failed(exc)` builds the error the main thread raises once `send` has raised `exc` (the thread
    ends there)."""

    def __init__(self, send: Callable[[Any], None], room: int, name: str,
                 failed: Callable[[BaseException], BaseException]):
        self._send, self._failed = send, failed
        self._items: queue.Queue = queue.Queue(maxsize=room)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while (item := self._items.get()) is not _STOP:
                self._send(item)
        except BaseException as exc:  # noqa: BLE001 - raised by the next hand / finish in the main thread
            self._error = exc

    def check(self) -> None:
        if self._error is not None:
            raise self._failed(self._error) from self._error

    def _offer(self, item: Any, deadline: float) -> bool:
        while self._thread.is_alive() and time.monotonic() < deadline:
            self.check()
            try:
                self._items.put(item, timeout=0.2)
                return True
            except queue.Full:  # the items before it are still on their way
                continue
        self.check()
        return False

    def hand(self, item: Any) -> None:
        """Queues `item`, waiting while `room` items wait already; raises the sender's failure instead."""
        if not self._offer(item, float("inf")):
            raise RuntimeError(f"{self._thread.name}: handed an item after finish()")

    def finish(self, timeout_s: float, unfinished: BaseException, *last: Any) -> None:
        """Hands over `last` (an end marker the receiver understands), waits until everything has been sent and
        ends the thread, all within `timeout_s`; raises the sender's failure, or `unfinished` when it is still
        sending at the deadline."""
        deadline = time.monotonic() + timeout_s
        for item in (*last, _STOP):
            if not self._offer(item, deadline):
                break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.check()
        if self._thread.is_alive():
            raise unfinished
