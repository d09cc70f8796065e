"""Process groups for verl's parallel engines: built once at one seam, passed explicitly below."""

from verl.distributed.process_groups import ProcessGroups, destroy_process_groups, init_process_groups

__all__ = ["ProcessGroups", "init_process_groups", "destroy_process_groups"]
