"""Moving one value of a run between rank sets (a plan's `Transfer`): shards re-split evenly over the consumer's
ranks, whole values copied from the producer's first rank, and a producer's failure sent in the value's place.

Every rank of the transfer first learns, in one small all-gather on the transfer's gloo control group, whether
each producer rank holds a shard (and its length), the whole value, or an error; then the pieces move with
point-to-point calls in the order `verl.dataflow.comm.plan_pieces` gives, the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from verl.dataflow import comm
from verl.dataflow.plan import MISSING, Transfer

__all__ = ["move"]

Error = tuple[str, int, str]
"""(node, rank, message) of a failure."""


def move(t: Transfer, vals: list, rank: int, failed: Error | None) -> Error | None:
    """Moves ``vals[t.src_slot]`` into ``vals[t.dst_slot]`` on the consumer's ranks (this rank's part of it).
    `failed`: this rank's own failure, sent in place of its value. Returns the producer's failure when any
    producer rank could not make the value (nothing is moved then), else None."""
    union = t.ranks
    if rank not in union:
        return None
    info: Any = None
    if rank in t.src_ranks:
        v = vals[t.src_slot]
        if v is MISSING or failed is not None:
            info = ("error", *(failed or (t.producer, rank, "the value was not produced")))
        elif t.replicated or not comm.is_shardable(v):
            info = ("whole", 0)
        else:
            info = ("shard", comm.shard_len(v))
    infos: list[Any] = [None] * len(union)
    dist.all_gather_object(infos, info, group=t.control)
    by_rank = dict(zip(union, infos))
    errors = [i for i in infos if i is not None and i[0] == "error"]
    if errors:
        return tuple(errors[0][1:])
    if by_rank[t.src_ranks[0]][0] == "whole":
        _copy_whole(t, vals, rank)
    else:
        _reshard(t, vals, rank, [by_rank[s][1] for s in t.src_ranks])
    return None


def _copy_whole(t: Transfer, vals: list, rank: int) -> None:
    src = t.src_ranks[0]
    for d in t.dst_ranks:
        if d in t.src_ranks:
            if d == rank:
                vals[t.dst_slot] = vals[t.src_slot]
        elif rank == src:
            comm.send_value(vals[t.src_slot], d)
        elif rank == d:
            vals[t.dst_slot] = comm.recv_value(src)


def _reshard(t: Transfer, vals: list, rank: int, lengths: list[int]) -> None:
    mine = []
    for s, d, lo, hi in comm.plan_pieces(lengths, t.src_ranks, t.dst_ranks):
        if s == rank and d == rank:
            mine.append(vals[t.src_slot][lo:hi])
        elif s == rank:
            comm.send_value(vals[t.src_slot][lo:hi], d)
        elif d == rank:
            mine.append(comm.recv_value(s))
    if mine:
        vals[t.dst_slot] = comm.concat(mine)
