"""verl: Megatron-centric RL post-training for LLMs (HybridFlow dataflow, 3D-HybridEngine, fused kernels).

The public API is re-exported here; heavy subsystems import lazily so `import verl` stays cheap.

    from verl import DataflowNode, CustomNode, build_dataflow, inject_node, debug, VerlRuntimeError
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from verl.errors import VerlConfigError, VerlError, VerlRuntimeError  # noqa: E402

# name -> module that defines it; imported on first access (PEP 562) so that `import verl` does not pull in
# torch and tensordict for users who only want, say, the CLI's --help.
_LAZY = {
    "DataflowNode": "verl.dataflow", "CustomNode": "verl.dataflow", "Dataflow": "verl.dataflow",
    "build_dataflow": "verl.dataflow", "inject_node": "verl.dataflow", "run": "verl.dataflow",
    "NodeContext": "verl.dataflow", "NodeConfig": "verl.dataflow", "TransientError": "verl.dataflow",
    "mark_transient": "verl.dataflow",
}
_SUBMODULES = ("debug", "dataflow")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"verl.{name}")
    raise AttributeError(f"module 'verl' has no attribute '{name}'")


__all__ = ["VerlError", "VerlConfigError", "VerlRuntimeError", "__version__", *_LAZY, *_SUBMODULES]
