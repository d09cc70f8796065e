"""A queued input (`NodeConfig.queue`): a bounded first-in-first-out channel from a producer's ranks to its
consumer's ranks, so the two stages run at their own pace.

The producer's ranks `put` each run's value (or its failure) at the end of the run: the value is cut into one
piece per consumer rank (the even re-split `comm.plan_pieces` gives; a value copied whole goes from the
producer's first rank) and handed to a sender thread, which sends the pieces in order over a gloo group of its
own (so it never interleaves with the main thread's collectives). A gloo send completes only once the
receiver has posted its receive, so the sender holds one value until a consumer takes it, up to `size` more wait
behind it in the producer's memory, and `put` blocks while they are all there: a producer is at most
`size` + 1 values ahead of the consumer's takes. Each consumer rank `get`s one message from every producer
rank, in order, and joins them. A failure travels in the value's place, so the consumer's run fails on every
consumer rank, naming the producer's node and rank.

A producer's ranks also keep their shares of the last `size` + 1 values put (`journal`): a checkpoint of the
producer stores the ones the consumer has not trained on yet, and a resumed producer `put`s them again before its
next run, so the consumer takes exactly what it would have (the PPO trainer's async mode).

Ends: `drain` waits until everything put has been sent (the producer's last run); a consumer that stops
taking leaves the producer's sender waiting in a send, which the job's collective timeout ends. A process that
dies closes its connections, so the peer's next send or receive fails at once (or at the timeout) and names
the queue.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist

from verl.dataflow import comm
from verl.distributed.sender import Sender
from verl.errors import VerlRuntimeError


class QueueChannel:
    """One queued (producer, key) towards one consumer rank set; see the module docstring."""

    def __init__(self, producer: str, key: str, src: tuple[int, ...], dst: tuple[int, ...], size: int,
                 replicated: bool, group: Any, control: Any):
        self.producer, self.key, self.src, self.dst = producer, key, src, dst
        self.size, self.replicated = size, replicated
        self.group, self.control = group, control
        self.rank = dist.get_rank()
        self._sender: Sender | None = None
        self.journal: deque = deque(maxlen=size + 1)
        """This rank's shares of the last values put (oldest first): at most `size` + 1 are ever unconsumed."""

    @property
    def name(self) -> str:
        return f"'{self.key}' queued from '{self.producer}' {list(self.src)} -> {list(self.dst)}"

    # -- producer side ------------------------------------------------------------------------------------
    def put(self, value: Any, failure: tuple[str, int, str] | None = None) -> None:
        """This rank's share of the run's value (a shard, or the whole value), or the run's failure (node, rank,
        message). Collective over the producer's ranks (they agree on the shards' lengths)."""
        if failure is not None:
            info = ("error", *failure)
        elif self.replicated or not comm.is_shardable(value):
            info = ("whole", 0)
        else:
            info = ("shard", comm.shard_len(value))
        infos = [info]
        if len(self.src) > 1:
            infos = [None] * len(self.src)
            dist.all_gather_object(infos, info, group=self.control)
        messages = self._messages(value, infos)
        if failure is None:
            self.journal.append(value)
        if self._sender is None:
            self._sender = Sender(self._send, self.size, f"verl-queue-{self.key}", self._send_failed)
        self._sender.hand(messages)

    def _messages(self, value: Any, infos: list) -> list[tuple[int, Any]]:
        """(consumer rank, message) for every consumer rank: exactly one each, so consumers know what to take."""
        errors = [i for i in infos if i[0] == "error"]
        if errors:
            return [(d, ("error",) + tuple(errors[0][1:])) for d in self.dst]
        if infos[0][0] == "whole":
            first = self.rank == self.src[0]
            return [(d, ("whole", value if first else None)) for d in self.dst]
        pieces = {(s, d): (lo, hi) for s, d, lo, hi in comm.plan_pieces([i[1] for i in infos], self.src, self.dst)}
        return [(d, ("shard", value[slice(*pieces[(self.rank, d)])] if (self.rank, d) in pieces else None))
                for d in self.dst]

    def _send(self, messages: list[tuple[int, Any]]) -> None:
        for d, msg in messages:
            comm.send_value(msg, d, group=self.group)

    def _send_failed(self, exc: BaseException) -> VerlRuntimeError:
        return VerlRuntimeError(f"the consumer's ranks {list(self.dst)} of {self.name} stopped taking values (their "
                                f"run failed, or they exited: their own error says why); sending failed with "
                                f"{type(exc).__name__}: {exc}", rank=self.rank, cause=exc)

    def drain(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) until every value put has been sent (the producer's last run), then stops
        the sender."""
        if self._sender is None:
            return
        self._sender.finish(timeout_s, VerlRuntimeError(f"{self.name}: values still unsent after {timeout_s:g} s; "
                                                        f"the consumer took fewer values than the producer made",
                                                        rank=self.rank))
        self._sender = None

    # -- consumer side ------------------------------------------------------------------------------------
    def get(self) -> tuple[Any, tuple[str, int, str] | None]:
        """(this rank's share of the next value, None), or (None, (node, rank, message)) when the producer's run
        that made it failed. Blocks until every producer rank's message has arrived."""
        got = [comm.recv_value(s, group=self.group) for s in self.src]
        for m in got:
            if m[0] == "error":
                return None, (m[1], m[2], m[3])
        if got[0][0] == "whole":
            return got[0][1], None
        pieces = [m[1] for m in got if m[1] is not None]
        nonempty = [p for p in pieces if comm.shard_len(p) > 0]
        return comm.concat(nonempty or pieces[:1]), None
