"""init_process_groups refuses what cannot work, with the fix in the message (layouts themselves are
checked on 4 ranks in tests/models/test_matrix.py)."""

from __future__ import annotations

import pytest

from verl.distributed import ProcessGroups, init_process_groups
from verl.errors import VerlConfigError


def test_needs_torch_distributed_first():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(VerlConfigError, match="torch.distributed"):
        init_process_groups(tp=1, pp=1)


def test_dataclass_is_typed_and_frozen():
    assert ProcessGroups.__dataclass_params__.frozen
    assert {"tp", "pp", "dp", "tp_rank", "pp_size", "dp_size", "sequence_parallel"} <= set(
        ProcessGroups.__dataclass_fields__)
