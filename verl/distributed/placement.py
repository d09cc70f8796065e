"""Where this process sits: the one placement object, built once at start-up and passed down explicitly.

    placement = init_placement("auto")                           # torchrun env vars → NCCL on GPUs, gloo on CPU
    placement = init_placement("auto", tp=2, pp=2, sequence_parallel=True)   # + megatron-core's parallel state
    model = build_gpt(hf_config, placement); worker = TorchEngine(module, optim, placement)

`Placement` holds the world (rank, size, device) and the training layout TP × PP × DP with its process groups
(megatron-core's rank order tp-dp-pp: rank = t + TP·(d + DP·p)). Mixture-of-experts layers cut the same ranks
another way (megatron-core's expert groups): expert TP (ETP, default TP) × expert parallel (EP) × expert DP × PP,
rank = e_t + ETP·(e + EP·(e_d + EDP·p)): each EP rank holds 1/EP of every MoE layer's experts, and EP lives inside
the data-parallel ranks (EP × ETP × PP divides the world). This module is the only place that reads
megatron-core's global `parallel_state`; everything below receives the placement. `Placement.layout(...)`
describes a layout by its sizes alone (no process, no groups), which is what the reshard planner reads.

Timeouts: one collective timeout per job (`trainer.collective_timeout_s`, set by `init_placement`) bounds every
process group the job creates: the default group, megatron-core's groups, and the ones made later with
`new_group` (the dataflow's per-node and control groups, FSDP meshes, engine groups). torch's own
``dist.new_group`` does not inherit the default group's timeout (it falls back to 30 minutes), so verl code
creates groups through `new_group` here. A collective that waits longer than the timeout raises on the waiting
rank instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError

__all__ = ["Placement", "check_expert_layout", "init_placement", "init_process_groups", "destroy_process_groups",
           "pick_device",
           "collective_timeout", "new_group", "DEFAULT_TIMEOUT_S", "free_port"]

DEFAULT_TIMEOUT_S = 600.0
_timeout_s: float | None = None  # set by init_placement; None: read the default group's, else the default


def free_port() -> int:
    """A TCP port that is free on localhost right now (a one-process job's own rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """This rank's place in the world and in the training layout TP × PP × DP (= world)."""

    rank: int = 0
    """This process's index among the placement's ranks (the global rank for the whole world)."""
    world_size: int = 1
    """Number of ranks the placement spans (the world, or a role's rank set: see `subset`)."""
    local_rank: int = 0
    """Rank on this node (torchrun's LOCAL_RANK): the GPU index."""
    device: torch.device = torch.device("cpu")
    """The device this rank computes on."""
    tp_size: int = 1
    """Tensor-parallel size (ranks that split each weight matrix)."""
    pp_size: int = 1
    """Pipeline-parallel size (successive layer stages)."""
    dp_size: int = 1
    """Data-parallel size (replicas of one model shard); world = TP × PP × DP."""
    tp_rank: int = 0
    """This rank's index in its TP group."""
    pp_rank: int = 0
    """This rank's pipeline stage (0 holds the embeddings)."""
    dp_rank: int = 0
    """This rank's index among the data-parallel replicas: which prompts it gets."""
    sequence_parallel: bool = False
    """Activations outside attention/MLP are split along the sequence over the TP group (needs tp_size > 1)."""
    tp: dist.ProcessGroup | None = None
    """Tensor-parallel group (megatron engines only)."""
    pp: dist.ProcessGroup | None = None
    """Pipeline-parallel group (megatron engines only)."""
    dp: dist.ProcessGroup | None = None
    """Data-parallel group (None when the world is one rank)."""
    mp: dist.ProcessGroup | None = None
    """Model-parallel group: the TP × PP ranks of this rank's replica (megatron engines only)."""
    global_ranks: tuple[int, ...] | None = None
    """Global ranks the placement spans, in order (None: the whole world, rank i = global rank i)."""
    group: dist.ProcessGroup | None = None
    """Process group over `global_ranks` (None: the world group, when distributed)."""
    tp_global_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's TP group, in TP order."""
    ep_size: int = 1
    """Expert-parallel size: the ranks that split each MoE layer's experts between them (megatron engines)."""
    etp_size: int = 1
    """Expert tensor-parallel size: the ranks that split each expert's matrices (megatron-core's default: TP)."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds experts [ep_rank·E/EP, (ep_rank+1)·E/EP)."""
    etp_rank: int = 0
    """This rank's index in its expert tensor-parallel group."""
    ep: dist.ProcessGroup | None = None
    """Expert-parallel group (megatron engines with EP > 1)."""
    etp: dist.ProcessGroup | None = None
    """Expert tensor-parallel group (megatron engines only)."""
    pp_global_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, in stage order."""

    # -- the world --------------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """Rank 0: logs, plots and writes the files every rank shares."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.rank if self.global_ranks is None else self.global_ranks[self.rank]

    def global_of(self, rank: int) -> int:
        """The world rank of the placement's `rank`-th rank."""
        return rank if self.global_ranks is None else self.global_ranks[rank]

    def subset(self, ranks: tuple[int, ...], group: dist.ProcessGroup | None) -> "Placement":
        """The placement of a role that runs on `ranks` (world ranks, this process among them): plain data
        parallel over them, with `group` spanning exactly those ranks (a split-placement critic on ranks 2-3
        averages its gradients over its own two ranks)."""
        me = self.global_rank
        if me not in ranks:
            raise VerlConfigError(f"rank {me} is not among {list(ranks)}: only the role's ranks build its placement")
        local = ranks.index(me)
        whole = ranks == tuple(range(dist.get_world_size() if dist.is_initialized() else 1))
        return Placement(rank=local, world_size=len(ranks), local_rank=self.local_rank, device=self.device,
                         dp_size=len(ranks), dp_rank=local, dp=group if len(ranks) > 1 else None,
                         global_ranks=None if whole else tuple(ranks), group=group,
                         tp_global_ranks=(me,), pp_global_ranks=(me,))

    # -- the training layout ----------------------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, t: int, d: int, p: int) -> int:
        """Global rank of (tp index, dp index, pp stage) in megatron's tp-dp-pp order."""
        return t + self.tp_size * (d + self.dp_size * p)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp index, dp index, pp stage) of `rank`."""
        return rank % self.tp_size, (rank // self.tp_size) % self.dp_size, rank // (self.tp_size * self.dp_size)

    @property
    def edp_size(self) -> int:
        """Expert data-parallel size: copies of each expert shard (world / (ETP × EP × PP))."""
        return self.world_size // (self.etp_size * self.ep_size * self.pp_size)

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(expert TP index, EP index, expert DP index, pp stage) of `rank` (megatron-core's expert rank order)."""
        per_stage = self.world_size // self.pp_size
        local = rank % per_stage
        return (local % self.etp_size, (local // self.etp_size) % self.ep_size,
                local // (self.etp_size * self.ep_size), rank // per_stage)

    def expert_rank_of(self, t: int, e: int, d: int, p: int) -> int:
        """Global rank of (expert TP index, EP index, expert DP index, pp stage)."""
        return t + self.etp_size * (e + self.ep_size * (d + self.edp_size * p))

    @classmethod
    def layout(cls, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, etp: int | None = None) -> "Placement":
        """A layout by its sizes alone (rank 0, no process groups): what planners and tests reason about. `ep` /
        `etp` (default: tp) describe how the MoE layers' experts are cut over the same ranks."""
        etp = tp if etp is None else etp
        for name, v in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("etp", etp)):
            if v < 1:
                raise VerlConfigError(f"layout {name}={v} must be >= 1")
        check_expert_layout(world=tp * pp * dp, pp=pp, ep=ep, etp=etp)
        return cls(world_size=tp * pp * dp, tp_size=tp, pp_size=pp, dp_size=dp, ep_size=ep, etp_size=etp)


def check_expert_layout(*, world: int, pp: int, ep: int, etp: int) -> None:
    """megatron-core's rule for the expert layout over `world` ranks, refused with the values that break it."""
    if ep < 1 or etp < 1:
        raise VerlConfigError(f"actor.megatron.ep={ep} and etp={etp} must be >= 1")
    if world % (etp * ep * pp):
        raise VerlConfigError(f"actor.megatron.etp={etp} x ep={ep} x pp={pp} = {etp * ep * pp} does not divide the "
                              f"{world} ranks (megatron-core cuts the experts over ETP x EP x expert-DP per pipeline "
                              f"stage); pick ep and etp whose product with pp divides {world}")


def comm_device() -> torch.device:
    """Where small host numbers must live to be all-reduced: the GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise VerlConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e9:
        raise VerlConfigError(f"collective timeout must be a finite number of seconds > 0, got {timeout_s!r}; "
                              f"set trainer.collective_timeout_s (default {DEFAULT_TIMEOUT_S:.0f})")
    return float(timeout_s)


def collective_timeout() -> datetime.timedelta:
    """The job's collective timeout: the one `init_placement` was given; else (a process group created by other
    code, e.g. a test harness) the default group's own; else DEFAULT_TIMEOUT_S."""
    if _timeout_s is not None:
        return datetime.timedelta(seconds=_timeout_s)
    if dist.is_available() and dist.is_initialized():
        try:  # private but stable since torch 2.0; only a fallback for groups verl did not create
            return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):
            pass
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def new_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` with the job's collective timeout (unless the caller passes ``timeout``)."""
    kwargs.setdefault("timeout", collective_timeout())
    return dist.new_group(ranks, **kwargs)


def _join_world(device: torch.device, timeout_s: float) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        # torchrun keeps one store for all the worker groups it starts: a restarted group would find the keys
        # (gloo's peer addresses) of the group before it and connect to dead ranks. Each attempt gets its own.
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"verl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)


def init_placement(device_choice: str = "auto", *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                   ep: int = 1, etp: int | None = None, seed: int = 1234, megatron: bool = False,
                   process_group: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> Placement:
    """Joins (or creates) the default process group from torchrun's env vars and returns this rank's placement.

    A lone process needs no process group, unless megatron-core is used (`megatron=True`, or tp/pp > 1) or
    something else needs one (`process_group=True`: vLLM / SGLang, which would otherwise make their own): it
    then gets a one-rank gloo group, and with megatron its parallel state is initialised (TP × PP, the rest DP;
    the experts of MoE layers over ETP × EP, see `init_process_groups`).
    `timeout_s` bounds every collective of the job (see the module docstring).
    """
    global _timeout_s
    _timeout_s = _check_timeout(timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    _join_world(device, timeout_s)
    megatron = megatron or tp * pp > 1
    if (megatron or process_group) and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if megatron:
        return init_process_groups(tp=tp, pp=pp, sequence_parallel=sequence_parallel, ep=ep, etp=etp, seed=seed,
                                   device=device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return Placement(rank=rank, world_size=world, local_rank=local_rank, device=device, dp_size=world, dp_rank=rank,
                     dp=dist.group.WORLD if world > 1 else None, tp_global_ranks=(rank,), pp_global_ranks=(rank,))


def init_process_groups(*, tp: int = 1, pp: int = 1, sequence_parallel: bool = False, ep: int = 1,
                        etp: int | None = None, seed: int = 1234, device: torch.device | None = None) -> Placement:
    """Initialises megatron-core's parallel state (TP × PP, the rest DP; MoE experts over ETP × EP, `etp`
    defaulting to `tp`) and its RNG; returns the placement.

    Call once per process after `torch.distributed.init_process_group`. Calling it again with the same sizes
    returns the existing layout; different sizes first need `destroy_process_groups()`.
    """
    import megatron_patches
    megatron_patches.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise VerlConfigError("init_process_groups needs torch.distributed initialised first "
                              "(torchrun, or verl.testing.run_distributed in tests)")
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise VerlConfigError(f"tp={tp} x pp={pp} must divide the world size {world}; choose sizes whose product "
                              f"divides {world}")
    if sequence_parallel and tp == 1:
        raise VerlConfigError("sequence_parallel=True needs tp > 1 (it splits the sequence over the TP group)")
    etp = tp if etp is None else etp
    check_expert_layout(world=world, pp=pp, ep=ep, etp=etp)
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
        if have != (tp, pp, ep, etp):
            raise VerlConfigError(
                f"megatron parallel state already initialised with (tp, pp, ep, etp)={have}; call "
                f"destroy_process_groups() before tp={tp}, pp={pp}, ep={ep}, etp={etp}")
    else:
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)  # one GPU per process; megatron allocates on the current device
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                     distributed_timeout_minutes=collective_timeout().total_seconds() / 60)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    pp_group, tp_group = ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group()
    return Placement(
        rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=device,
        tp_size=tp, pp_size=pp, dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), sequence_parallel=sequence_parallel,
        tp=tp_group, pp=pp_group, dp=ps.get_data_parallel_group(), mp=ps.get_model_parallel_group(),
        tp_global_ranks=tuple(dist.get_process_group_ranks(tp_group)),
        pp_global_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        ep_size=ep, etp_size=etp, ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group())


def destroy_process_groups() -> None:
    """Tears down megatron's parallel state (the torch.distributed default group stays)."""
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
