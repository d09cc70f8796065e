"""The batch protocol: what flows between the nodes of the PPO dataflow.

A `DataProto` is one `tensordict.TensorDict` with batch dimension 0 holding per-sample tensors *and*
per-sample non-tensor fields (prompt strings, uids, ground-truth answers, as `NonTensorStack`), plus ``meta``,
a plain dict of batch-level values (temperature, global step, metrics) that every slice shares.

    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                non_tensors={"prompt": prompts, "uid": uids}, meta={"temperature": 1.0})
    rollouts = batch.repeat_interleave(4)                 # n samples per prompt, kept adjacent (GRPO groups)
    padded, pad = rollouts.pad_to_divisor(dp_size)        # so that every data-parallel rank gets as many
    mine = padded.dp_shard(ctx.dp_rank, ctx.dp_size)      # this rank's shard (ctx: the node's NodeContext)
    out = mine.union(DataProto.from_dict(tensors={"old_log_probs": lp}))
    full = out.all_gather(ctx.process_group).unpad(pad)   # back to the whole batch, padding dropped

Indexing, slicing, selection, concatenation and repetition are TensorDict's own operations; this class only
names the ones an RL step needs and keeps ``meta`` alongside.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from verl.errors import VerlConfigError, nearest

__all__ = ["DataProto"]


def _even_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class DataProto:
    """A batch of samples: per-sample tensors and non-tensor fields in ``batch``, batch-level ``meta``."""

    __slots__ = ("batch", "meta")

    def __init__(self, batch: TensorDictBase | None = None, meta: Mapping[str, Any] | None = None):
        if batch is None:
            batch = TensorDict({}, batch_size=[0])
        if not isinstance(batch, TensorDictBase):
            raise VerlConfigError(f"DataProto(batch=...) takes a TensorDict, got {type(batch).__name__}; use "
                                  f"DataProto.from_dict(tensors=..., non_tensors=...) to build one from dicts")
        if len(batch.batch_size) < 1:
            raise VerlConfigError("DataProto needs a TensorDict with a batch dimension (batch_size=[N])")
        self.batch = batch
        self.meta = dict(meta or {})

    @classmethod
    def from_dict(cls, tensors: Mapping[str, torch.Tensor] | None = None,
                  non_tensors: Mapping[str, Sequence[Any]] | None = None, meta: Mapping[str, Any] | None = None,
                  batch_size: int | None = None) -> "DataProto":
        """Builds a batch; every tensor's dim 0 and every non-tensor list's length must be the batch size."""
        tensors, non_tensors = dict(tensors or {}), dict(non_tensors or {})
        sizes = {k: (t.shape[0] if t.dim() else None) for k, t in tensors.items()}
        sizes.update({k: len(v) for k, v in non_tensors.items()})
        n = batch_size if batch_size is not None else next(iter(sizes.values()), 0)
        bad = {k: s for k, s in sizes.items() if s != n}
        if bad:
            raise VerlConfigError(f"DataProto fields must share the batch size {n} along dim 0; these differ: {bad}")
        batch = TensorDict(tensors, batch_size=[n])
        for k, v in non_tensors.items():
            batch.set(k, NonTensorStack.from_list(list(v)))
        return cls(batch, meta)

    # ---- access ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.batch.batch_size[0]

    def keys(self) -> list[str]:
        return list(self.batch.keys())

    @property
    def tensor_keys(self) -> list[str]:
        return [k for k in self.batch.keys() if not self.batch.is_non_tensor(k)]

    @property
    def non_tensor_keys(self) -> list[str]:
        return [k for k in self.batch.keys() if self.batch.is_non_tensor(k)]

    def __contains__(self, key: object) -> bool:
        return key in self.batch.keys()

    def __getitem__(self, index: Any) -> Any:
        """``batch["key"]``: a tensor, or a list for a non-tensor field; anything else indexes samples."""
        if isinstance(index, str):
            if index not in self.batch.keys():
                raise KeyError(f"DataProto has no field '{index}'{nearest(index, self.keys(), 'fields')}")
            v = self.batch.get(index)
            if self.batch.is_non_tensor(index):
                return v.tolist() if hasattr(v, "tolist") else [v.data] * len(self)
            return v
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return DataProto(self.batch[index], self.meta)

    def __setitem__(self, key: str, value: Any) -> None:
        """Sets a per-sample field: a tensor with dim 0 == len(self), or a sequence of that length."""
        n = len(self)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != n:
                raise VerlConfigError(f"field '{key}' has shape {tuple(value.shape)} but the batch has {n} samples; "
                                      f"put batch-level values in .meta")
            self.batch.set(key, value)
        else:
            value = list(value)
            if len(value) != n:
                raise VerlConfigError(f"field '{key}' has {len(value)} items but the batch has {n} samples")
            self.batch.set(key, NonTensorStack.from_list(value))

    # ---- structure --------------------------------------------------------------------------------------------
    def select(self, *keys: str) -> "DataProto":
        """The batch with only ``keys`` (meta kept)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"DataProto.select: no fields {missing}{nearest(missing[0], self.keys(), 'fields')}")
        return DataProto(self.batch.select(*keys), self.meta)

    def exclude(self, *keys: str) -> "DataProto":
        return DataProto(self.batch.exclude(*keys), self.meta)

    def union(self, other: "DataProto") -> "DataProto":
        """Fields of both batches (same length). A field in both must be equal; meta is merged the same way."""
        if len(other) != len(self):
            raise VerlConfigError(f"DataProto.union: batches of {len(self)} and {len(other)} samples; union joins "
                                  f"fields of the same samples")
        for k in other.keys():
            if k in self and not _same(self[k], other[k]):
                raise VerlConfigError(f"DataProto.union: field '{k}' differs between the batches; rename one or "
                                      f"exclude it before the union")
        for k, v in other.meta.items():
            if k in self.meta and not _same(self.meta[k], v):
                raise VerlConfigError(f"DataProto.union: meta '{k}' differs ({self.meta[k]!r} vs {v!r})")
        batch = self.batch.clone(recurse=False)
        batch.update(other.batch.exclude(*[k for k in other.keys() if k in self]))
        return DataProto(batch, {**self.meta, **other.meta})

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Exactly ``chunks`` consecutive parts; sizes differ by at most one (``tensor_split`` boundaries)."""
        if not isinstance(chunks, int) or chunks < 1:
            raise VerlConfigError(f"DataProto.chunk: chunks must be an int >= 1, got {chunks!r}")
        return [DataProto(b, self.meta) for b in self.batch.split(_even_sizes(len(self), chunks), dim=0)]

    @staticmethod
    def concat(items: Iterable["DataProto"]) -> "DataProto":
        """Samples of ``items`` one after another; meta of the first (later ones fill missing keys)."""
        items = list(items)
        if not items:
            raise VerlConfigError("DataProto.concat needs at least one batch")
        keys = set(items[0].keys())
        for i, it in enumerate(items[1:], 1):
            if set(it.keys()) != keys:
                raise VerlConfigError(f"DataProto.concat: batch {i} has fields {sorted(it.keys())} but batch 0 has "
                                      f"{sorted(keys)}; select the same fields first")
        meta: dict[str, Any] = {}
        for it in reversed(items):
            meta.update(it.meta)
        return DataProto(torch.cat([it.batch for it in items], dim=0), meta)

    def repeat_interleave(self, repeats: int) -> "DataProto":
        """Each sample ``repeats`` times in a row: [a, b] -> [a, a, b, b] (n responses per prompt)."""
        if not isinstance(repeats, int) or repeats < 1:
            raise VerlConfigError(f"DataProto.repeat_interleave: repeats must be an int >= 1, got {repeats!r}")
        return DataProto(self.batch.repeat_interleave(repeats, dim=0), self.meta)

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """The batch padded to a multiple of ``divisor`` by repeating its first samples (real samples, so no
        model sees a degenerate row), and the number of samples added; undo with `unpad`."""
        if not isinstance(divisor, int) or divisor < 1:
            raise VerlConfigError(f"DataProto.pad_to_divisor: divisor must be an int >= 1, got {divisor!r}")
        n = len(self)
        pad = (-n) % divisor
        if pad == 0:
            return self, 0
        if n == 0:
            raise VerlConfigError("DataProto.pad_to_divisor: cannot pad an empty batch")
        extra = self.batch[torch.arange(pad) % n]
        return DataProto(torch.cat([self.batch, extra], dim=0), self.meta), pad

    def unpad(self, pad: int) -> "DataProto":
        """Drops the ``pad`` samples `pad_to_divisor` added."""
        if pad < 0 or pad > len(self):
            raise VerlConfigError(f"DataProto.unpad: pad must be in [0, {len(self)}], got {pad}")
        return self if pad == 0 else DataProto(self.batch[: len(self) - pad], self.meta)

    # ---- data parallel --------------------------------------------------------------------------------------
    def dp_shard(self, dp_rank: int, dp_size: int) -> "DataProto":
        """This data-parallel rank's consecutive shard (the same boundaries the dataflow uses)."""
        if not 0 <= dp_rank < dp_size:
            raise VerlConfigError(f"DataProto.dp_shard: dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        return self.chunk(dp_size)[dp_rank]

    def all_gather(self, group: Any = None) -> "DataProto":
        """Every rank of ``group``'s shard, concatenated in rank order (inverse of `dp_shard`); shards may differ
        in length. Non-tensor fields travel too, so this uses torch.distributed's object collective."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return self
        n = dist.get_world_size(group)
        if n == 1:
            return self
        shards: list[Any] = [None] * n
        dist.all_gather_object(shards, self.to("cpu"), group=group)
        device = next((t.device for t in self.batch.values() if isinstance(t, torch.Tensor)), None)
        out = DataProto.concat(shards)
        return out.to(device) if device is not None and device.type != "cpu" else out

    # ---- misc ----------------------------------------------------------------------------------------------
    def to(self, device: Any) -> "DataProto":
        return DataProto(self.batch.to(device), self.meta)

    def clone(self) -> "DataProto":
        return DataProto(self.batch.clone(), dict(self.meta))

    def summary(self) -> dict[str, Any]:
        """Types, shapes and dtypes (for traces and logs), never the data."""
        fields: dict[str, Any] = {}
        for k in self.batch.keys():
            if self.batch.is_non_tensor(k):
                fields[k] = {"type": "list", "len": len(self)}
            else:
                t = self.batch.get(k)
                fields[k] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        return {"type": "DataProto", "len": len(self), "fields": fields, "meta": sorted(map(str, self.meta))}

    def __repr__(self) -> str:
        f = self.summary()["fields"]
        parts = [f"{k}: {v['dtype']}{v['shape']}" if "dtype" in v else f"{k}: list" for k, v in f.items()]
        return f"DataProto(len={len(self)}, fields={{{', '.join(parts)}}}, meta={sorted(self.meta)})"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return a is b
