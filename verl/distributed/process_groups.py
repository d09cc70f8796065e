"""The one seam between verl and megatron-core's global parallel state.

`init_process_groups(tp=..., pp=...)` initialises megatron's parallel state once (after
`torch.distributed` is up) and returns a `ProcessGroups` that everything below receives explicitly; only this
module reads `megatron.core.parallel_state`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError


@dataclass(kw_only=True, slots=True, frozen=True)
class ProcessGroups:
    """The TP / PP / DP layout of this rank (TP x PP x DP = world, megatron order tp-cp-ep-dp-pp)."""

    tp: dist.ProcessGroup
    """Tensor-parallel group (ranks that split each weight matrix)."""
    pp: dist.ProcessGroup
    """Pipeline-parallel group (ranks that hold successive layer stages)."""
    dp: dist.ProcessGroup
    """Data-parallel group (replicas of this rank's shard)."""
    tp_rank: int
    """This rank's index in `tp`."""
    tp_size: int
    """Size of `tp`."""
    pp_rank: int
    """This rank's pipeline stage (0 = embeddings)."""
    pp_size: int
    """Number of pipeline stages."""
    dp_rank: int
    """This rank's index in `dp`."""
    dp_size: int
    """Size of `dp`."""
    sequence_parallel: bool
    """Whether activations outside attention/MLP are split along the sequence over `tp` (needs tp_size > 1)."""
    pp_global_ranks: tuple[int, ...]
    """Global ranks of `pp`, in stage order (for sends between stages and gathers to the first stage)."""
    tp_global_ranks: tuple[int, ...]
    """Global ranks of `tp`, in TP-rank order."""

    @property
    def is_first_stage(self) -> bool:
        """Holds the embeddings (pre-process)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the final norm and output layer (post-process)."""
        return self.pp_rank == self.pp_size - 1


def init_process_groups(*, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                        seed: int = 1234) -> ProcessGroups:
    """Initialises megatron's parallel state (TP x PP, the rest DP) and its RNG; returns the groups.

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
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp:
            raise VerlConfigError(
                f"megatron parallel state already initialised with tp={ps.get_tensor_model_parallel_world_size()}, "
                f"pp={ps.get_pipeline_model_parallel_world_size()}; call destroy_process_groups() before "
                f"tp={tp}, pp={pp}")
    else:
        if torch.cuda.is_available():
            # One GPU per process (torchrun's LOCAL_RANK); megatron allocates on the current device.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pp_group = ps.get_pipeline_model_parallel_group()
    tp_group = ps.get_tensor_model_parallel_group()
    return ProcessGroups(
        tp=tp_group, pp=pp_group, dp=ps.get_data_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        pp_global_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        tp_global_ranks=tuple(dist.get_process_group_ranks(tp_group)),
    )


def destroy_process_groups() -> None:
    """Tears down megatron's parallel state (the torch.distributed default group stays)."""
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
