"""Small collectives over a `Placement` (metrics, barriers); each is a no-op in a one-rank world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.distributed.placement import Placement, comm_device


def all_reduce_mean_(t: torch.Tensor, world: Placement) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t)
        t /= world.world_size
    return t


def reduce_metrics(metrics: dict[str, float], world: Placement, maxed: tuple[str, ...] = (),
                   mined: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-rank scalar metrics -> the same on every rank: the mean over ranks, except the keys in `maxed`
    (maximum over ranks) and `mined` (minimum). Two collectives whatever the number of keys."""
    if not world.distributed:
        return dict(metrics)
    extremes = [(k, 1.0) for k in maxed if k in metrics] + [(k, -1.0) for k in mined if k in metrics]
    names = {k for k, _ in extremes}
    means = sorted(k for k in metrics if k not in names)
    dev = comm_device()
    vec = torch.tensor([metrics[k] for k in means], dtype=torch.float64, device=dev)
    ext = torch.tensor([sign * metrics[k] for k, sign in extremes], dtype=torch.float64, device=dev)
    all_reduce_mean_(vec, world)
    dist.all_reduce(ext, op=dist.ReduceOp.MAX)  # the minimum is minus the maximum of the negated values
    out = dict(zip(means, vec.tolist()))
    out.update({k: sign * v for (k, sign), v in zip(extremes, ext.tolist())})
    return out


def barrier(world: Placement) -> None:
    if world.distributed:
        dist.barrier()


def mean_over(group, value: float) -> float:
    """The mean of a per-rank number over `group` (a node's process group; None: this rank alone)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)
