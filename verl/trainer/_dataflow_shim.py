"""Interim stand-in for `verl.dataflow` (DataflowNode / build_dataflow) until that package lands on this
branch; removed then. Same call shapes: nodes declare input/output keys, the graph is inferred from keys."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from verl.errors import VerlConfigError, VerlRuntimeError


@dataclass
class _Node:
    fn: Callable
    input_keys: list[str]
    output_keys: list[str]

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def DataflowNode(input_keys: list[str], output_keys: list[str]):  # noqa: N802 - mirrors the public API
    return lambda fn: _Node(fn, list(input_keys), list(output_keys))


class _Flow:
    def __init__(self, nodes: list[_Node]):
        producers = {k: n.name for n in nodes for k in n.output_keys}
        order, done, pending = [], set(), list(nodes)
        while pending:
            ready = [n for n in pending if all(k not in producers or producers[k] in done for k in n.input_keys)]
            if not ready:
                raise VerlConfigError(f"dataflow has a cycle among {[n.name for n in pending]}")
            for n in ready:
                order.append(n)
                done.add(n.name)
                pending.remove(n)
        self.nodes, self.timings = order, {}

    def run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        state = dict(inputs)
        for node in self.nodes:
            missing = [k for k in node.input_keys if k not in state]
            if missing:
                raise VerlConfigError(f"node '{node.name}' needs {missing}, which no node or input provides")
            t0 = time.perf_counter()
            try:
                out = node.fn(*[state[k] for k in node.input_keys])
            except VerlRuntimeError:
                raise
            except Exception as e:  # noqa: BLE001
                raise VerlRuntimeError(f"{type(e).__name__}: {e}", node=node.name, cause=e) from e
            self.timings[node.name] = time.perf_counter() - t0
            if len(node.output_keys) == 1:
                out = (out,)
            state.update(zip(node.output_keys, out, strict=True))
        return state


def build_dataflow(nodes: list[_Node], configs: dict | None = None) -> _Flow:
    return _Flow(nodes)
