"""verl.distributed.sender.Sender: in-order sending on a thread, failures raised in the main thread, and an end
that never waits on a dead sender."""

from __future__ import annotations

import threading
import time

import pytest

from verl.distributed.sender import Sender


def _failed(exc: BaseException) -> RuntimeError:
    return RuntimeError(f"sending failed: {exc}")


def test_items_are_sent_in_order_and_finish_waits_for_them():
    sent = []
    sender = Sender(lambda item: (time.sleep(0.01), sent.append(item)), 2, "test-sender", _failed)
    for i in range(5):
        sender.hand(i)
    sender.finish(10.0, TimeoutError("unfinished"), "end")
    assert sent == [0, 1, 2, 3, 4, "end"]


def test_a_failed_send_is_raised_at_the_next_hand_even_with_the_room_full():
    def send(item):
        if item == 1:
            raise OSError("peer closed")
        time.sleep(0.05)
    sender = Sender(send, 1, "test-sender", _failed)
    with pytest.raises(RuntimeError, match="sending failed: peer closed"):
        for i in range(10):  # the dead sender never frees the room: hand raises instead of waiting
            sender.hand(i)


def test_finish_on_a_dead_sender_with_a_full_room_raises_its_failure_at_once():
    release = threading.Event()

    def send(item):
        release.wait()
        raise OSError("peer closed")
    sender = Sender(send, 1, "test-sender", _failed)
    sender.hand(0)
    sender.hand(1)  # the room is full behind the stuck first send
    release.set()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer closed"):
        sender.finish(30.0, TimeoutError("unfinished"), "end")
    assert time.monotonic() - start < 5


def test_finish_raises_unfinished_when_the_sender_is_still_busy_at_the_deadline():
    release = threading.Event()
    sender = Sender(lambda item: release.wait(), 1, "test-sender", _failed)
    sender.hand(0)
    with pytest.raises(TimeoutError, match="unfinished"):
        sender.finish(0.5, TimeoutError("unfinished"))
    release.set()
