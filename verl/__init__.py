"""verl: Megatron-centric RL post-training for LLMs (HybridFlow dataflow, 3D-HybridEngine, fused kernels).

The public API is re-exported here; heavy subsystems import lazily so `import verl` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

from verl.errors import VerlRuntimeError  # noqa: E402

__all__ = ["VerlRuntimeError", "__version__"]
