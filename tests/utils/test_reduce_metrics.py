"""Metrics reduced over data-parallel ranks: means are averaged, extremes take the max / min over ranks."""

from __future__ import annotations

import pytest
import torch

from verl.testing import run_distributed
from verl.distributed import Placement
from verl.distributed.collectives import reduce_metrics


def _reduce(rank, world_size):
    world = Placement(rank=rank, world_size=world_size, local_rank=rank, dp_size=world_size, dp_rank=rank)
    local = {"reward/mean": [0.25, 0.75][rank], "reward/max": [1.0, 3.0][rank], "reward/min": [-2.0, 0.5][rank],
             "actor/entropy": [1.0, 2.0][rank]}
    return reduce_metrics(local, world, maxed=("reward/max",), mined=("reward/min",))


@pytest.mark.multiprocess
def test_extremes_are_max_and_min_over_ranks_and_the_rest_is_averaged():
    r0, r1 = run_distributed(_reduce, 2, timeout=120)
    assert r0 == r1 == {"reward/mean": 0.5, "reward/max": 3.0, "reward/min": -2.0, "actor/entropy": 1.5}


def test_one_process_returns_its_own_metrics():
    world = Placement()
    assert reduce_metrics({"reward/max": 2.0}, world, maxed=("reward/max",)) == {"reward/max": 2.0}
