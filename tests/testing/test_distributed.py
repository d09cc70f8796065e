"""The multi-process harness: results per rank, failures named by rank, timeouts instead of hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from verl.testing import RankFailure, run_distributed

pytestmark = pytest.mark.multiprocess


def _all_reduce(rank, world_size, scale):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale, "env_rank": int(os.environ["RANK"])}


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # would wait for rank 1 forever without the harness
    return rank


def _sleep_forever(rank, world_size):
    time.sleep(600)


def _exit_hard(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_results_in_rank_order():
    out = run_distributed(_all_reduce, world_size=3, args=(2.0,), timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert [o["env_rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"] == 12.0 for o in out)


def test_rank_exception_names_rank():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 failed: ValueError: boom on purpose") as info:
        run_distributed(_fail_on_one, world_size=2, timeout=60)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30, "the healthy rank must be stopped, not waited for"


def test_timeout_instead_of_hang():
    with pytest.raises(RankFailure, match="timed out"):
        run_distributed(_sleep_forever, world_size=2, timeout=8)


def test_hard_exit_is_reported():
    with pytest.raises(RankFailure, match="rank 0"):
        run_distributed(_exit_hard, world_size=2, timeout=60)


def _store_after_rank_0_returned(rank, world_size):
    if rank == 1:  # rank 0 has returned (and exited) by now: the rendezvous store must still answer
        time.sleep(4.0)
        dist.distributed_c10d._get_default_store().add("late", 1)  # (a set is not answered: add is)
    return rank


def test_the_store_outlives_rank_0():
    assert run_distributed(_store_after_rank_0_returned, world_size=2, timeout=60) == [0, 1]
