"""Moving values between ranks when a producer and its consumer run on different rank sets.

Data-parallel values (a row batch such as the PPO flow's `RolloutBatch`, a TensorDict, a tensor with a batch
dimension, a list) are shards along
dim 0: the logical value is the producers' shards concatenated in rank order, and it is re-split evenly
(``tensor_split`` style) across the consumer's ranks. Other values (numbers, dicts, models) and outputs listed
in a node's ``replicated_outputs`` are copied whole from the producer's first rank.

Tensors travel with ``torch.distributed.send/recv`` on the backend's device; only a small skeleton (shapes,
dtypes, non-tensor fields such as prompt strings) is pickled. Every rank walks the same list of pieces in the
same order, so blocking point-to-point calls cannot deadlock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from verl.distributed.placement import comm_device, new_group

_GROUPS: dict[tuple, Any] = {}


def group_for(ranks: tuple[int, ...]) -> Any:
    """A process group over ``ranks`` (the world group for all of them). Collective: every rank must ask for
    the same groups in the same order, which the dataflow plan guarantees."""
    world = dist.get_world_size()
    if ranks == tuple(range(world)):
        return dist.group.WORLD
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        _GROUPS[key] = new_group(list(ranks))
    return _GROUPS[key]


def control_group(ranks: tuple[int, ...]) -> Any:
    """A gloo (CPU) group over ``ranks`` for the runtime's small control messages: error agreement, shard
    sizes, end-of-run status. On NCCL jobs this keeps those messages off the GPU streams, so agreeing that no
    rank failed never waits for the GPU work a node queued. It is never the group a node is given (even on
    gloo jobs): a rank that failed mid-node joins the agreement while its peers may still sit in a collective
    of that node, and on a shared group the two would be matched with each other. Collective like
    `group_for`."""
    key = (id(dist.group.WORLD), ranks, "gloo")
    if key not in _GROUPS:
        _GROUPS[key] = new_group(list(ranks), backend="gloo")
    return _GROUPS[key]


# ---- data-parallel shards ----------------------------------------------------------------------------------
def _is_row_batch(v: Any) -> bool:
    """A row batch: a dataclass of per-row fields that slices with ``v[lo:hi]`` and joins with
    ``type(v).concat(pieces)`` (the PPO flow's `RolloutBatch`, or a user's own): sharded by rows, sent field by
    field."""
    return dataclasses.is_dataclass(v) and not isinstance(v, type) and callable(getattr(type(v), "concat", None)) \
        and callable(getattr(v, "__getitem__", None))


def is_shardable(v: Any) -> bool:
    from tensordict import TensorDictBase
    if isinstance(v, torch.Tensor):
        return v.dim() >= 1
    if isinstance(v, TensorDictBase):
        return len(v.batch_size) >= 1
    return isinstance(v, (list, tuple)) or _is_row_batch(v)


def shard_len(v: Any) -> int:
    from tensordict import TensorDictBase
    if isinstance(v, torch.Tensor):
        return v.shape[0]
    if isinstance(v, TensorDictBase):
        return v.batch_size[0]
    return len(v)


def concat(pieces: list[Any]) -> Any:
    from tensordict import TensorDictBase
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if _is_row_batch(first):
        return type(first).concat(pieces)
    if isinstance(first, (torch.Tensor, TensorDictBase)):
        return torch.cat(pieces, dim=0)
    if isinstance(first, tuple):
        return tuple(x for p in pieces for x in p)
    return [x for p in pieces for x in p]


def even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``tensor_split`` boundaries: the first ``total % parts`` parts get one extra item."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def plan_pieces(lengths: list[int], src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """(src_rank, dst_rank, lo, hi) pieces, ordered by destination then source, that re-split shards of
    ``lengths`` held by ``src`` evenly over ``dst``. A destination with nothing to receive gets an empty piece
    from ``src[0]`` (so that it still learns the value's type and trailing shape)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    pieces = []
    for d, (a, b) in zip(dst, even_ranges(offsets[-1], len(dst))):
        mine = []
        for j, s in enumerate(src):
            lo, hi = max(a, offsets[j]), min(b, offsets[j + 1])
            if lo < hi:
                mine.append((s, d, lo - offsets[j], hi - offsets[j]))
        pieces.extend(mine or [(src[0], d, 0, 0)])
    return pieces


def _device_of(group: Any) -> torch.device:
    return comm_device() if group is None or dist.get_backend(group) != "gloo" else torch.device("cpu")


# ---- the wire format -------------------------------------------------------------------------------------
def flatten(v: Any, tensors: list[torch.Tensor]) -> Any:
    """A picklable skeleton of ``v``; its tensors are appended to ``tensors`` (sent separately)."""
    from tensordict import TensorDictBase
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return ("T", tuple(v.shape), v.dtype, v.requires_grad)
    if _is_row_batch(v):
        return ("B", type(v), [(f.name, flatten(getattr(v, f.name), tensors)) for f in dataclasses.fields(v)])
    if isinstance(v, TensorDictBase):
        keys = list(v.keys(include_nested=True, leaves_only=True))
        rest = v.exclude(*keys) if keys else v
        return ("TD", type(v), tuple(v.batch_size), keys, [flatten(v.get(k), tensors) for k in keys],
                rest.to("cpu") if rest.device is not None else rest)
    if type(v) in (list, tuple):
        return ("L" if type(v) is list else "U", [flatten(x, tensors) for x in v])
    if type(v) is dict:
        return ("D", [(k, flatten(x, tensors)) for k, x in v.items()])
    return ("O", v)


def unflatten(skel: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`; consumes ``tensors`` from the front (a list reversed by the caller)."""
    kind = skel[0]
    if kind == "T":
        t = tensors.pop()
        return t.requires_grad_(True) if skel[3] and t.is_floating_point() else t
    if kind == "B":
        return skel[1](**{name: unflatten(c, tensors) for name, c in skel[2]})
    if kind == "TD":
        _, _, batch_size, keys, children, rest = skel
        out = rest.clone(recurse=False)
        out.batch_size = torch.Size(batch_size)
        for k, c in zip(keys, children):
            out.set(k, unflatten(c, tensors))
        return out
    if kind in ("L", "U"):
        items = [unflatten(c, tensors) for c in skel[1]]
        return items if kind == "L" else tuple(items)
    if kind == "D":
        return {k: unflatten(c, tensors) for k, c in skel[1]}
    return skel[1]


def _tensor_specs(skel: Any, out: list) -> list:
    kind = skel[0]
    if kind == "T":
        out.append((skel[1], skel[2]))
    elif kind == "B":
        for _, c in skel[2]:
            _tensor_specs(c, out)
    elif kind == "TD":
        for c in skel[4]:
            _tensor_specs(c, out)
    elif kind in ("L", "U"):
        for c in skel[1]:
            _tensor_specs(c, out)
    elif kind == "D":
        for _, c in skel[1]:
            _tensor_specs(c, out)
    return out


def send_value(v: Any, dst: int, group: Any = None) -> None:
    """``v`` to global rank ``dst`` over ``group`` (the default group: None); a gloo group sends from the CPU."""
    tensors: list[torch.Tensor] = []
    skel = flatten(v, tensors)
    dist.send_object_list([skel], dst=dst, group=group)
    dev = _device_of(group)
    for t in tensors:
        dist.send(t.detach().to(dev).contiguous(), dst=dst, group=group)


def recv_value(src: int, group: Any = None) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    skel = box[0]
    dev = _device_of(group)
    tensors = []
    for shape, dtype in _tensor_specs(skel, []):
        buf = torch.empty(shape, dtype=dtype, device=dev)
        dist.recv(buf, src=src, group=group)
        tensors.append(buf)
    tensors.reverse()
    return unflatten(skel, tensors)
