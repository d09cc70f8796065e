"""The one placement object (world, TP × PP × DP layout, process groups, device), built once at one seam and
passed explicitly below."""

from verl.distributed.placement import (Placement, comm_device, destroy_process_groups, init_placement,
                                        init_process_groups, pick_device)

__all__ = ["Placement", "comm_device", "destroy_process_groups", "init_placement", "init_process_groups",
           "pick_device"]
