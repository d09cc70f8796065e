"""Debugging aids for dataflows.

    from verl import debug
    out = debug.trace_dataflow(dataflow=flow, inputs=batch, save_path="./trace.json")

The file is Chrome trace-event JSON: open it in https://ui.perfetto.dev, chrome://tracing or VS Code. Each
rank is a process row; each node is one bar on it with the node's inputs and outputs summarised (shapes,
dtypes, lengths), its device, engine and retries; data moved between differently placed nodes shows on a
second "redistribute" track.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.dataflow import Dataflow


def trace_dataflow(dataflow: Dataflow | Mapping[str, Any], inputs: Mapping[str, Any],
                   save_path: str = "./trace.json", hooks: Sequence[Any] = ()) -> dict[str, Any]:
    """Runs ``dataflow`` on ``inputs``, writes the trace to ``save_path`` (rank 0 writes every rank's events)
    and returns the run's outputs. On failure the trace is still written, then the VerlRuntimeError raised."""
    return Dataflow.from_dict(dataflow).run(inputs, trace=save_path, hooks=hooks)


__all__ = ["trace_dataflow"]
