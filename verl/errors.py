"""Exceptions shared by every verl layer."""

from __future__ import annotations


class VerlError(Exception):
    """Base class of verl's own errors."""


class VerlConfigError(VerlError, ValueError):
    """A configuration, graph or argument error found before any work starts; the message says what to change."""


class VerlRuntimeError(VerlError, RuntimeError):
    """A failure inside a dataflow node or an engine.

    Names the node, the rank and the cause; the original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, node: str | None = None, rank: int | None = None,
                 cause: BaseException | None = None):
        self.node = node
        self.rank = rank
        self.cause = cause
        parts = []
        if node is not None:
            parts.append(f"node '{node}'")
        if rank is not None:
            parts.append(f"rank {rank}")
        prefix = f"[{', '.join(parts)}] " if parts else ""
        super().__init__(prefix + message)

    def __reduce__(self):  # picklable across processes (multi-rank error propagation)
        return (_rebuild_runtime_error, (self.args[0], self.node, self.rank))


def _rebuild_runtime_error(message, node, rank):
    err = VerlRuntimeError.__new__(VerlRuntimeError)
    RuntimeError.__init__(err, message)
    err.node, err.rank, err.cause = node, rank, None
    return err
