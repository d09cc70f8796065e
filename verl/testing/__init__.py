"""Test utilities that ship with verl (usable by downstream projects too)."""

from verl.testing.distributed import RankFailure, run_distributed

__all__ = ["RankFailure", "run_distributed"]
