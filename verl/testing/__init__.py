"""Test utilities that ship with verl (usable by downstream projects too)."""

from verl.testing.distributed import RankFailure, free_port, run_distributed

__all__ = ["RankFailure", "free_port", "run_distributed"]
