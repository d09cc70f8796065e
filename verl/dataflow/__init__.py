"""verl's programming model: an RL algorithm is a small graph of plain Python functions.

    from verl import DataflowNode, CustomNode, build_dataflow, inject_node

    @DataflowNode(input_keys=["prompt", "actor_model"], output_keys=["response"])
    def generate(prompt, actor_model):
        return actor_model.generate(prompt, max_new_tokens=64)

    @DataflowNode(input_keys=["response", "reward_model"], output_keys=["reward"])
    def score(response, reward_model, ctx=None):         # ctx: this node's NodeContext (rank, device, engine...)
        return reward_model.score(response)

    flow = build_dataflow(nodes=[generate, score],
                          configs={"generate": dict(engine="vllm", device_map=[0, 1]),
                                   "score": dict(device_map=[2, 3])})
    out = flow.run({"prompt": prompts, "actor_model": actor, "reward_model": rm})

Modules: `node` (decorators, NodeContext), `config` (NodeConfig), `graph` (building, validation,
injection: the read-only description), `plan` (compiling and caching one rank's plan), `execute` (running
it: agreements, failures, stages), `call` (one node call: outputs, offload, retries, timeouts), `transfer`
(moving a value between rank sets; `comm` is its wire format), `state` (values carried between runs), `queue`
(queued inputs between stages that run at their own pace), `trace` (Chrome traces, hooks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.dataflow.config import NodeConfig, node_engines
from verl.dataflow.graph import Dataflow, build_dataflow, inject_node
from verl.dataflow.node import (
    CustomNode,
    DataflowNode,
    Node,
    NodeContext,
    NodeEntry,
    TransientError,
    get_node,
    mark_transient,
    registered_nodes,
)
from verl.dataflow.state import RunState
from verl.dataflow.trace import NodeEvent, TraceRecorder, summarize


def run(dataflow: Dataflow | Mapping[str, Any], inputs: Mapping[str, Any], *, trace: str | None = None,
        hooks: Sequence[Any] = (), check_errors: str = "node", state: RunState | None = None) -> dict[str, Any]:
    """Runs a dataflow (built, or in dict form) with ``inputs``; see `Dataflow.run`."""
    return Dataflow.from_dict(dataflow).run(inputs, trace=trace, hooks=hooks, check_errors=check_errors,
                                            state=state)


__all__ = [
    "CustomNode", "Dataflow", "DataflowNode", "Node", "NodeConfig", "NodeContext", "NodeEntry",
    "NodeEvent", "RunState", "TraceRecorder", "TransientError", "build_dataflow", "get_node", "inject_node",
    "mark_transient", "node_engines", "registered_nodes", "run", "summarize",
]
