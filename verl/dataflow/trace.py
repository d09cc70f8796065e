"""Chrome trace-event JSON for dataflow runs (opens in Perfetto, chrome://tracing, VS Code).

One complete event (``"ph": "X"``) per node per rank, with ``pid`` = rank and ``args`` holding the node's
input and output summaries (shapes, dtypes, lengths; never tensor contents), device, engine, ranks and
retries. Redistribution between differently placed nodes shows as ``comm`` events on a second track.

Timestamps are wall-clock, so nodes of disjoint rank sets that run at once (a rollout generating the next
batch while the trainer's ranks update on the previous one) show as overlapping bars on their ranks' rows.
Every event's ``args`` carry the run index (``run``, counted by the `RunState`), the inputs read from earlier
runs (``lag``), and any value with a ``weight_version`` tensor (a rollout batch: the policy version that
generated each sample) summarised with its min / max version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_MAX_FIELDS = 32


def summarize(value: Any, depth: int = 0) -> Any:
    """A small JSON-able description of a value: type, shape, dtype, length; never the data of a tensor."""
    import torch
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return {"type": "str", "len": len(value)}
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "device": str(value.device)}
    versions = getattr(value, "weight_version", None)
    if isinstance(versions, torch.Tensor) and versions.numel():
        return {"type": type(value).__name__, "len": len(value), "weight_version": [int(versions.min()),
                                                                                   int(versions.max())]}
    if depth >= 2:
        return {"type": type(value).__name__}
    try:
        from tensordict import TensorDictBase
        if isinstance(value, TensorDictBase):
            return {"type": type(value).__name__, "batch_size": list(value.batch_size),
                    "fields": {str(k): summarize(v, depth + 1) for k, v in list(value.items())[:_MAX_FIELDS]}}
    except ImportError:  # pragma: no cover - tensordict is a dependency
        pass
    if isinstance(value, torch.nn.Module):
        return {"type": type(value).__name__, "params": sum(p.numel() for p in value.parameters())}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__len__"):  # row batch
        return {"type": type(value).__name__, "len": len(value),
                "fields": {f.name: summarize(getattr(value, f.name), depth + 1)
                           for f in dataclasses.fields(value)[:_MAX_FIELDS]}}
    if isinstance(value, (list, tuple)):
        out: dict[str, Any] = {"type": type(value).__name__, "len": len(value)}
        if value:
            out["item"] = summarize(value[0], depth + 1)
        return out
    if isinstance(value, Mapping):
        return {"type": type(value).__name__, "len": len(value),
                "fields": {str(k): summarize(v, depth + 1) for k, v in list(value.items())[:_MAX_FIELDS]}}
    shape = getattr(value, "shape", None)
    if shape is not None:
        return {"type": type(value).__name__, "shape": [int(s) for s in shape],
                "dtype": str(getattr(value, "dtype", ""))}
    return {"type": type(value).__name__}


@dataclass(slots=True)
class NodeEvent:
    """What hooks receive for each node run on a rank (``outputs``/``error`` are None before it ends)."""

    node: str
    """The node's name."""
    rank: int
    """The rank running it."""
    ranks: tuple[int, ...]
    """All ranks running it."""
    device: str
    """Its device on this rank."""
    engine: str
    """Its engine name."""
    inputs: Mapping[str, Any]
    """Its input values by key."""
    start_s: float
    """``time.perf_counter()`` when it started."""
    outputs: Mapping[str, Any] | None = None
    """Its output values by key (on success)."""
    duration_s: float = 0.0
    """How long it ran, retries included."""
    retries: int = 0
    """How many retries it needed."""
    error: BaseException | None = None
    """The exception that failed it, if any."""
    lag: Mapping[str, int] | None = None
    """Its inputs read from earlier runs (key -> runs back), if any."""


class TraceRecorder:
    """A hook that records trace events; the runtime adds the rank merge and writes the file."""

    def __init__(self, run: int = 0) -> None:
        self.run = run
        """Index of the traced run (the `RunState`'s count of earlier runs; 0 without one)."""
        # Wall-clock origin so that events from different processes line up; durations use perf_counter.
        self._wall0_us = time.time_ns() / 1000.0
        self._perf0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def ts_us(self, perf_s: float) -> float:
        return self._wall0_us + (perf_s - self._perf0) * 1e6

    def on_node_start(self, event: NodeEvent) -> None:
        pass

    def on_node_end(self, event: NodeEvent) -> None:
        args: dict[str, Any] = {
            "inputs": {k: summarize(v) for k, v in event.inputs.items()},
            "outputs": {k: summarize(v) for k, v in (event.outputs or {}).items()},
            "device": event.device, "engine": event.engine, "ranks": list(event.ranks), "retries": event.retries,
            "run": self.run,
        }
        if event.lag:
            args["lag"] = dict(event.lag)
        if event.error is not None:
            args["error"] = f"{type(event.error).__name__}: {event.error}"
        self.events.append({"name": event.node, "cat": "node", "ph": "X", "ts": self.ts_us(event.start_s),
                            "dur": event.duration_s * 1e6, "pid": event.rank, "tid": 0, "args": args})

    def on_transfer(self, name: str, rank: int, start_s: float, end_s: float, args: dict[str, Any]) -> None:
        self.events.append({"name": name, "cat": "comm", "ph": "X", "ts": self.ts_us(start_s),
                            "dur": (end_s - start_s) * 1e6, "pid": rank, "tid": 1, "args": {**args, "run": self.run}})


def write_trace(path: str, events_per_rank: list[list[dict[str, Any]]], metadata: dict[str, Any],
                ranks: Sequence[int] | None = None) -> str:
    """Writes merged events as a Chrome trace-event JSON object; returns the path. `ranks`: whose events each
    list holds (default 0, 1, ...; a stage of a dataflow with queues names its own)."""
    events: list[dict[str, Any]] = []
    for rank, evs in zip(ranks if ranks is not None else range(len(events_per_rank)), events_per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "nodes"}})
        if any(e["cat"] == "comm" for e in evs):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "redistribute"}})
        events.extend(sorted(evs, key=lambda e: e["ts"]))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}, f, indent=1)
    os.replace(tmp, path)
    return path


def merge_traces(paths: Sequence[str], out: str) -> str:
    """One Chrome trace from several written by `write_trace` (the stages of a dataflow with queues each write
    their own; timestamps are wall-clock, so they line up). Returns `out`."""
    events: list[dict[str, Any]] = []
    meta: dict[str, Any] = {"merged": []}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        events += data["traceEvents"]
        meta["merged"].append(data.get("otherData", {}))
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}, f, indent=1)
    os.replace(tmp, out)
    return out
