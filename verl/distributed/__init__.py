"""The one placement object (world, TP × PP × DP layout, process groups, device), built once at one seam and
passed explicitly below; the roles of a job (which ranks and engine each runs on, `roles.py`); and the few small
collectives the trainer runs over them."""

from verl.distributed.collectives import barrier, mean_over, reduce_metrics
from verl.distributed.placement import (DEFAULT_TIMEOUT_S, Placement, collective_timeout, comm_device,
                                        destroy_process_groups, init_placement, init_process_groups, new_group,
                                        pick_device)
from verl.distributed.roles import Role, resolve_roles

__all__ = ["DEFAULT_TIMEOUT_S", "Placement", "barrier", "collective_timeout", "comm_device", "destroy_process_groups",
           "init_placement", "init_process_groups", "mean_over", "new_group", "pick_device", "reduce_metrics", "Role",
           "resolve_roles"]
