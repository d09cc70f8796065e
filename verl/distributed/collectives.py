"""Small collectives over a `Placement` (metrics, barriers); each is a no-op in a one-rank world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.distributed.placement import Placement, comm_device


def all_reduce_mean_(t: torch.Tensor, world: Placement) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, group=world.group)
        t /= world.world_size
    return t


def reduce_metrics(metrics: dict[str, float], world: Placement, maxed: tuple[str, ...] = (),
                   mined: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-rank scalar metrics -> the same on every rank: the mean over the ranks that report each key (in
    split placement the critic's ranks report critic/*, the actor's actor/*), except the keys in `maxed`
    (maximum over ranks) and `mined` (minimum). Three collectives whatever the number of keys."""
    if not world.distributed:
        return dict(metrics)
    everyone: list = [None] * world.world_size
    dist.all_gather_object(everyone, sorted(metrics), group=world.group)
    keys = sorted(set().union(*everyone))
    extremes = [(k, 1.0) for k in maxed if k in keys] + [(k, -1.0) for k in mined if k in keys]
    names = {k for k, _ in extremes}
    means = [k for k in keys if k not in names]
    dev = comm_device()
    # sums and counts in one vector: [value_1 .. value_n, present_1 .. present_n]
    vec = torch.tensor([metrics.get(k, 0.0) for k in means] + [float(k in metrics) for k in means],
                       dtype=torch.float64, device=dev)
    ext = torch.tensor([sign * metrics[k] if k in metrics else -float("inf") for k, sign in extremes],
                       dtype=torch.float64, device=dev)
    dist.all_reduce(vec, group=world.group)
    dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=world.group)  # min = -max of the negated values
    n = len(means)
    out = {k: s / c for k, s, c in zip(means, vec[:n].tolist(), vec[n:].tolist())}
    out.update({k: sign * v for (k, sign), v in zip(extremes, ext.tolist())})
    return out


def gather_lists(values: list, world: Placement) -> list:
    """Every rank's `values` joined, in rank order, on every rank of `world` (collective)."""
    if not world.distributed:
        return list(values)
    everyone: list = [None] * world.world_size
    dist.all_gather_object(everyone, list(values), group=world.group)
    return [v for part in everyone for v in part]


def barrier(world: Placement) -> None:
    if world.distributed:
        dist.barrier(group=world.group)


def mean_over(group, value: float) -> float:
    """The mean of a per-rank number over `group` (a node's process group; None: this rank alone)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def agree_first(local: tuple | None, groups) -> tuple | None:
    """The smallest of the ranks' `local` values (picklable, mutually ordered tuples; None: nothing to report)
    over every rank the `groups` reach together, the same on all of them; None when no rank has one.

    The groups are agreed over one after another, so a megatron model-parallel group followed by its
    data-parallel group covers the whole TP × PP × DP world (every rank of the second group already holds its
    first group's minimum). Each group costs one one-element all-reduce; values are exchanged only when some
    rank of the group has one, which is the rare case this is made for (a step that went wrong). A group that
    is None or has one rank is skipped."""
    best = local
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        flag = torch.tensor([0.0 if best is None else 1.0], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if float(flag) == 0.0:
            continue
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, best, group=group)
        best = min(v for v in everyone if v is not None)
    return best
