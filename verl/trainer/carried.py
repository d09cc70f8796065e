"""The batches one_step_off / async carry between steps, as JSON for the checkpoint's trainer state.

Checkpoints are data: nothing here unpickles or imports by name. A value is JSON as it is (numbers, strings,
lists, dicts: the prompts' rows), a tensor becomes its dtype, shape and raw bytes in base64, and a
`RolloutBatch` (the only dataclass the PPO flow carries) its fields.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

from verl.utils.checkpoint import b64_to_bytes, bytes_to_b64
from verl.utils.state_check import MAX_STEP, Dict, Each, Int, List, StateError
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


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def check_encoded(data: Any, where: str) -> None:
    """A value `encode` wrote, checked before `decode` builds anything from it: tensors of a plain dtype whose
    shape matches their bytes, batches of `RolloutBatch` fields, JSON data otherwise (StateError naming the path)."""
    stack = [(data, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, dict) and _TENSOR in value:
            _check_tensor(value, at)
        elif isinstance(value, dict) and _BATCH in value:
            fields = value[_BATCH]
            names = {f.name for f in dataclasses.fields(RolloutBatch)}
            if not isinstance(fields, dict) or not set(fields) <= names:
                raise StateError(at, f"a batch with fields other than RolloutBatch's ({', '.join(sorted(names))})")
            stack += [(v, f"{at}.{k}") for k, v in fields.items()]
        elif isinstance(value, dict):
            stack += [(v, f"{at}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(value)]
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            raise StateError(at, f"a {type(value).__name__} is not stored data")


def _check_tensor(value: dict, at: str) -> None:
    raw, dtype, shape = value.get(_TENSOR), value.get("dtype"), value.get("shape")
    if not isinstance(raw, str) or dtype not in _DTYPES or not isinstance(shape, list) or set(value) != {
            _TENSOR, "dtype", "shape"}:
        raise StateError(at, f"not a stored tensor (dtype must be one of {', '.join(sorted(_DTYPES))})")
    if not all(type(d) is int and 0 <= d < 1 << 40 for d in shape) or len(shape) > 8:
        raise StateError(at, f"shape {str(shape)[:60]}: must be at most 8 sizes in [0, 2**40)")
    if len(raw) % 4 or not _BASE64.fullmatch(raw):
        raise StateError(at, "its bytes are not base64 text")
    want = math.prod(shape) * getattr(torch, dtype).itemsize
    have = len(raw) * 3 // 4 - raw[-2:].count("=") if raw else 0
    if have != want:
        raise StateError(at, f"{have} bytes for a {dtype} tensor of shape {shape}, which needs {want}")


FLOW_STATE = Dict({"runs": Int(0, MAX_STEP), "carried": Dict({}, extra=List(Each(check_encoded)))})
"""What a rank's stored `RunState` (trainer_state.json's flow_state[r]) must hold."""


def encode_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A `RunState.state_dict()` as JSON-able data."""
    return {"runs": state_dict["runs"], "carried": {k: [encode(v) for v in vs]
                                                    for k, vs in state_dict["carried"].items()}}


def decode_state(data: dict[str, Any]) -> dict[str, Any]:
    return {"runs": data["runs"], "carried": {k: [decode(v) for v in vs] for k, vs in data["carried"].items()}}
