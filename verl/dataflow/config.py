"""Per-node configuration: placement, engine, offload, retries and setting overrides.

    build_dataflow(nodes=[generate, score], configs={
        "generate": dict(engine="vllm", device_map=["cuda:0", "cuda:1"]),
        "score": dict(engine="torch", device_map=[2, 3], cpu_offload=True, retries=2),
        "safe_reward_filter": dict(threshold=0.7),        # a node setting (a defaulted parameter)
    })

A device map lists the ranks that run the node: ints, or ``"cuda:i"`` / ``"cpu:i"`` meaning rank ``i`` (one
process per device, as torchrun launches). No device map means every rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from verl.errors import VerlConfigError, nearest
from verl.engines import KINDS, engines

DEFAULT_NODE_TIMEOUT_S = 3600.0
"""A node's time limit unless its config gives one: generous for any node of a training step, yet finite, so a
node that hangs (a stage whose peer is gone, a deadlocked engine) ends instead of holding its ranks forever.
`timeout_s=0` turns the limit off, on request only."""


def node_engines() -> tuple[str, ...]:
    """What a node's `engine` may name: any engine of `verl.engines` (generation, training, or `rule`: plain
    Python). The runtime hands it to the node's context; what runs the node is the worker the node calls."""
    return tuple(sorted({name for kind in KINDS for name in engines(kind)}))


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """How and where one node runs. Changing it never changes the node's code."""

    device_map: tuple[int, ...] | None = None
    """Global ranks that run the node, sorted; None = every rank (colocated, the default)."""
    device_types: tuple[str, ...] | None = None
    """Per entry of ``device_map``: 'cuda', 'cpu' or '' (an int rank: cuda when available, else cpu)."""
    engine: str = "torch"
    """Engine name handed to the node's context: one of `node_engines()`."""
    cpu_offload: bool = False
    """Keep the node's modules on CPU between calls; move them to the device just before the node runs."""
    retries: int = 0
    """Extra attempts after a transient error (TransientError, mark_transient, or a type in ``retry_on``)."""
    retry_backoff_s: float = 0.05
    """Sleep before the first retry; doubles on each further retry."""
    retry_on: tuple[type, ...] = ()
    """Exception types treated as transient for this node besides TransientError."""
    replicated_outputs: tuple[str, ...] = ()
    """Outputs every rank of the node holds whole (metrics, a scalar): when another rank set needs them they are
    copied from the node's first rank instead of being split/gathered as data-parallel shards."""
    timeout_s: float = DEFAULT_NODE_TIMEOUT_S
    """Longest the node may run on a rank, retries included (default DEFAULT_NODE_TIMEOUT_S, an hour; 0: no
    limit). Past it the node is interrupted and
    the run fails on every rank with VerlRuntimeError naming the node, the rank and the elapsed time (see
    `verl.dataflow.call` for what can and cannot be interrupted)."""
    lag: dict[str, int] = field(default_factory=dict)
    """Inputs read from an earlier run of the dataflow: ``{key: k}`` gives the node the value the key's producer
    made ``k`` runs ago (k >= 1) instead of this run's, so no ordering edge ties the two nodes within a run and a
    cycle through this input is allowed. The values are carried between runs by the `RunState` passed to
    ``run(..., state=...)``; while it holds fewer than ``k`` runs the node (and what depends on it) is skipped."""
    queue: dict[str, int] = field(default_factory=dict)
    """Inputs read through a bounded first-in-first-out queue: ``{key: size}``. The key's producer and this node
    then run on disjoint ranks and stop waiting for each other's runs: the producer's ranks run ahead, with up to
    ``size`` values waiting for this node, which takes them in the order they were made (its i-th run gets the
    producer's i-th value, as ``lag`` would, without the lockstep). Each rank then runs only its own stage (the
    nodes joined to it by ordinary inputs and dependencies), so the queues must split the graph; what flows
    back to a producing stage (a rollout's weights) travels outside the dataflow. See `verl.dataflow.queue` for
    what a failure or the end of the runs does to the other stage."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Overrides of the node's settings (its defaulted parameters)."""

    @classmethod
    def from_role(cls, role, **fields: Any) -> "NodeConfig":
        """A node that runs on `role` (a `verl.distributed.Role`): its ranks as the device map, its engine and
        cpu_offload; `fields` set the rest (a `device_map` given here replaces the role's ranks, e.g. for a node
        that spans two roles)."""
        fields.setdefault("device_map", tuple(role.ranks))
        return cls(engine=role.engine, cpu_offload=role.cpu_offload, **fields)


_FIELDS = tuple(f.name for f in fields(NodeConfig) if f.name != "device_types")


def parse_device_map(node: str, device_map: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    if device_map is None:
        return None
    if isinstance(device_map, (str, int)):
        device_map = [device_map]
    if not isinstance(device_map, Sequence) or len(device_map) == 0:
        raise VerlConfigError(f"node '{node}': device_map must be a non-empty list of ranks or 'cuda:i'/'cpu:i' "
                              f"strings, got {device_map!r}; omit it to run on every rank")
    entries: dict[int, str] = {}
    for d in device_map:
        if isinstance(d, bool):
            raise VerlConfigError(f"node '{node}': device_map entry {d!r} is a bool; use an int rank")
        if isinstance(d, int):
            rank, kind = d, ""
        elif isinstance(d, str) and ":" in d and d.split(":", 1)[0] in ("cuda", "cpu") \
                and d.split(":", 1)[1].isdigit():
            kind, idx = d.split(":", 1)
            rank = int(idx)
        else:
            raise VerlConfigError(f"node '{node}': device_map entry {d!r} is not an int rank or 'cuda:i'/'cpu:i'; "
                                  f"write e.g. 'cuda:0' or 0")
        if rank < 0:
            raise VerlConfigError(f"node '{node}': device_map entry {d!r} names a negative rank")
        if rank in entries:
            raise VerlConfigError(f"node '{node}': device_map names rank {rank} twice ({list(device_map)})")
        entries[rank] = kind
    ranks = tuple(sorted(entries))
    return ranks, tuple(entries[r] for r in ranks)


def make_config(node_name: str, raw: Any, settings: Mapping[str, Any]) -> NodeConfig:
    """A NodeConfig from a dict (or a NodeConfig), checking every key against the fields and node settings."""
    if raw is None:
        return NodeConfig(settings=dict(settings))
    if isinstance(raw, NodeConfig):
        as_dict = {f: getattr(raw, f) for f in _FIELDS}
        if raw.device_map is not None and raw.device_types is not None:
            as_dict["device_map"] = [f"{t}:{r}" if t else r for r, t in zip(raw.device_map, raw.device_types)]
        raw = as_dict
    if not isinstance(raw, Mapping):
        raise VerlConfigError(f"config of node '{node_name}' must be a dict or NodeConfig, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    merged = dict(settings)
    for key, value in raw.items():
        if key == "settings":
            if not isinstance(value, Mapping):
                raise VerlConfigError(f"node '{node_name}': settings must be a dict, got {type(value).__name__}")
            for s, v in value.items():
                _set_setting(node_name, s, v, settings, merged)
        elif key in _FIELDS:
            kwargs[key] = value
        elif key in settings:
            merged[key] = value
        else:
            raise VerlConfigError(f"node '{node_name}': unknown config key '{key}'"
                                  f"{nearest(key, list(_FIELDS) + list(settings), 'config keys and node settings')}")
    engine = kwargs.get("engine", "torch")
    if engine not in node_engines():
        raise VerlConfigError(f"node '{node_name}': unknown engine {engine!r}"
                              f"{nearest(engine, node_engines(), 'engines')}")
    retries = kwargs.get("retries", 0)
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise VerlConfigError(f"node '{node_name}': retries must be an int >= 0, got {retries!r}")
    backoff = kwargs.get("retry_backoff_s", 0.05)
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff < math.inf:
        raise VerlConfigError(f"node '{node_name}': retry_backoff_s must be a finite number >= 0, got {backoff!r}")
    cpu_offload = kwargs.get("cpu_offload", False)
    if not isinstance(cpu_offload, bool):  # bool("false") is True: a string here would silently offload
        raise VerlConfigError(f"node '{node_name}': cpu_offload must be true or false, got {cpu_offload!r}")
    retry_on = kwargs.get("retry_on", ())
    retry_on = (retry_on,) if isinstance(retry_on, type) else tuple(retry_on)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in retry_on):
        raise VerlConfigError(f"node '{node_name}': retry_on must list exception types, got {retry_on!r}")
    timeout = kwargs.get("timeout_s", DEFAULT_NODE_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout < 0:
        raise VerlConfigError(f"node '{node_name}': timeout_s must be a finite number of seconds >= 0 (0: no "
                              f"limit), got {timeout!r}")
    parsed = parse_device_map(node_name, kwargs.get("device_map"))
    lag = _parse_lag(node_name, kwargs.get("lag", {}))
    queue = _parse_lag(node_name, kwargs.get("queue", {}), what="queue")
    both = sorted(set(lag) & set(queue))
    if both:
        raise VerlConfigError(f"node '{node_name}': {both} appear in both lag and queue; read each input one way")
    replicated = kwargs.get("replicated_outputs", ())
    replicated = (replicated,) if isinstance(replicated, str) else tuple(replicated)
    return NodeConfig(device_map=parsed[0] if parsed else None, device_types=parsed[1] if parsed else None,
                      engine=engine, cpu_offload=cpu_offload, retries=retries,
                      retry_backoff_s=float(backoff), retry_on=retry_on, replicated_outputs=replicated,
                      timeout_s=float(timeout), lag=lag, queue=queue, settings=merged)


def _parse_lag(node_name: str, lag: Any, what: str = "lag") -> dict[str, int]:
    """``lag`` ({key: runs back}) or ``queue`` ({key: size}): positive ints per input key."""
    meaning = "runs back" if what == "lag" else "values the queue holds"
    if not isinstance(lag, Mapping):
        raise VerlConfigError(f"node '{node_name}': {what} must be a dict {{input key: {meaning}}}, e.g. "
                              f"{what}={{'batch': 1}}, got {lag!r}")
    out = {}
    for key, k in lag.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise VerlConfigError(f"node '{node_name}': {what}[{key!r}]={k!r} must be an int >= 1 (the number of "
                                  f"{meaning}); drop the entry to read this run's value")
        out[str(key)] = k
    return out


def _set_setting(node_name, key, value, settings, merged):
    if key not in settings:
        raise VerlConfigError(f"node '{node_name}': unknown setting '{key}'{nearest(key, settings, 'settings')}")
    merged[key] = value


def world_size_now() -> int:
    """The job's world size: torch.distributed's when initialised, else WORLD_SIZE (torchrun), else 1."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
