"""The batches one_step_off / async carry between steps, as JSON for the checkpoint's trainer state.

Checkpoints are data: nothing here unpickles or imports by name. A value is JSON as it is (numbers, strings,
lists, dicts: the prompts' rows), a tensor becomes its dtype, shape and raw bytes in base64, and a
`RolloutBatch` (the only dataclass the PPO flow carries) its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from verl.utils.checkpoint import b64_to_bytes, bytes_to_b64
from verl.workers.batch import RolloutBatch

_TENSOR, _BATCH = "__tensor__", "__rollout_batch__"


def encode(value: Any) -> Any:
    """`value` as JSON-able data (see the module docstring); raises TypeError for anything else."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = bytes_to_b64(t.reshape(-1).view(torch.uint8)) if t.numel() else ""
        return {_TENSOR: raw, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    if isinstance(value, RolloutBatch):
        return {_BATCH: {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} carried between steps in a checkpoint")


def decode(data: Any) -> Any:
    """The value `encode` described."""
    if isinstance(data, dict) and _TENSOR in data:
        dtype = getattr(torch, data["dtype"])
        raw = data[_TENSOR]
        flat = b64_to_bytes(raw).view(dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(data["shape"]).clone()
    if isinstance(data, dict) and _BATCH in data:
        return RolloutBatch(**{k: decode(v) for k, v in data[_BATCH].items()})
    if isinstance(data, dict):
        return {k: decode(v) for k, v in data.items()}
    if isinstance(data, list):
        return [decode(v) for v in data]
    return data


def encode_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A `RunState.state_dict()` as JSON-able data."""
    return {"runs": state_dict["runs"], "carried": {k: [encode(v) for v in vs]
                                                    for k, vs in state_dict["carried"].items()}}


def decode_state(data: dict[str, Any]) -> dict[str, Any]:
    return {"runs": data["runs"], "carried": {k: [decode(v) for v in vs] for k, vs in data["carried"].items()}}
