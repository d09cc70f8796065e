"""Process-group setup for the trainer: torchrun env vars → NCCL on GPUs, gloo on CPU; one process works too."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class World:
    """Where this process sits: rank, world size and its device (passed explicitly, never read globally)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from verl.errors import VerlConfigError
            raise VerlConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_world(device_choice: str = "auto", timeout_s: float = 1800.0) -> World:
    """Joins (or creates) the default process group from torchrun's env vars; a lone process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def ensure_process_group(world: World) -> None:
    """Creates a one-rank gloo group when running without torchrun (megatron-core needs a process group)."""
    if dist.is_initialized():
        return
    from verl.testing.distributed import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def all_reduce_mean_(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t)
        t /= world.world_size
    return t


def reduce_metrics(metrics: dict[str, float], world: World, maxed: tuple[str, ...] = (),
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


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def broadcast_object(obj, world: World, src: int = 0):
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def comm_device() -> torch.device:
    """Where small host-side numbers must live to be all-reduced: the GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_across_ranks(value: float) -> float:
    """The mean of a per-rank number over the default process group (the value itself without one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
