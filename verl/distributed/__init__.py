"""The one placement object (world, TP × PP × DP layout, process groups, device), built once at one seam and
passed explicitly below, and the few small collectives the trainer runs over it."""

from verl.distributed.collectives import barrier, mean_over, reduce_metrics
from verl.distributed.placement import (Placement, comm_device, destroy_process_groups, init_placement,
                                        init_process_groups, pick_device)

__all__ = ["Placement", "barrier", "comm_device", "destroy_process_groups", "init_placement",
           "init_process_groups", "mean_over", "pick_device", "reduce_metrics"]
