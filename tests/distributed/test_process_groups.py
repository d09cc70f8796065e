"""init_process_groups refuses what cannot work, with the fix in the message (layouts themselves are
checked on 4 ranks in tests/models/test_matrix.py)."""

from __future__ import annotations

import pytest

from verl.distributed import Placement, init_process_groups
from verl.errors import VerlConfigError


def test_needs_torch_distributed_first():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(VerlConfigError, match="torch.distributed"):
        init_process_groups(tp=1, pp=1)


def test_dataclass_is_typed_and_frozen():
    assert Placement.__dataclass_params__.frozen
    assert {"rank", "world_size", "device", "tp", "pp", "dp", "tp_rank", "pp_size", "dp_size",
            "sequence_parallel"} <= set(Placement.__dataclass_fields__)


def test_a_layout_by_sizes_alone_follows_megatrons_rank_order():
    p = Placement.layout(tp=2, pp=2, dp=3)
    assert p.world_size == 12 and p.tp is None
    assert [p.coords(r) for r in (0, 1, 2, 6, 11)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 2, 1)]
    assert all(p.rank_of(*p.coords(r)) == r for r in range(12))
    with pytest.raises(VerlConfigError, match="layout pp=0 must be >= 1"):
        Placement.layout(pp=0)
