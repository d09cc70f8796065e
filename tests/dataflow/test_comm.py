"""The redistribution planner (pure, one process) and the wire format's round trip."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from verl.dataflow import comm
from tests.dataflow.rows import Rows


@settings(max_examples=60, deadline=1000)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), st.integers(1, 6), st.integers(0, 3))
def test_pieces_reassemble_the_logical_batch_evenly(lengths, n_dst, shift):
    src = tuple(range(len(lengths)))
    dst = tuple(range(shift, shift + n_dst))  # overlapping, disjoint, sub- and super-sets of src
    logical = [(j, i) for j, n in enumerate(lengths) for i in range(n)]
    pieces = comm.plan_pieces(lengths, src, dst)
    per_dst = {d: [] for d in dst}
    for s, d, lo, hi in pieces:
        assert s in src and d in dst and 0 <= lo <= hi <= lengths[src.index(s)]
        per_dst[d].extend((src.index(s), i) for i in range(lo, hi))
    assert [x for d in dst for x in per_dst[d]] == logical          # order kept, nothing lost or duplicated
    sizes = [len(per_dst[d]) for d in dst]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # tensor_split boundaries
    order = [(dst.index(d), s) for s, d, _, _ in pieces]
    assert order == sorted(order)                                   # one global order: no p2p deadlock


def _roundtrip(v):
    tensors: list = []
    skel = comm.flatten(v, tensors)
    # What recv_value does: fresh buffers filled from the wire, consumed front to back.
    bufs = [t.clone() for t in tensors][::-1]
    return comm.unflatten(skel, bufs)


def test_wire_format_round_trips_batches_and_containers():
    b = Rows(ids=torch.arange(6).view(3, 2), text=["a", "b", "c"])
    back = _roundtrip(b)
    assert isinstance(back, Rows) and back.text == ["a", "b", "c"] and torch.equal(back.ids, b.ids)
    td = TensorDict({"x": torch.ones(2, 3), "nested": {"y": torch.zeros(2)}}, batch_size=[2])
    td.set("text", NonTensorStack.from_list(["p", "q"]))
    tdb = _roundtrip(td)
    assert torch.equal(tdb["nested", "y"], torch.zeros(2)) and tdb.get("text").tolist() == ["p", "q"]
    mixed = {"a": [torch.ones(2), "s", 3], "b": (torch.zeros(1),)}
    mb = _roundtrip(mixed)
    assert torch.equal(mb["a"][0], torch.ones(2)) and mb["a"][1:] == ["s", 3] and isinstance(mb["b"], tuple)


def test_shardable_values():
    assert comm.is_shardable(torch.zeros(3)) and not comm.is_shardable(torch.tensor(1.0))
    assert comm.is_shardable(["a"]) and not comm.is_shardable({"a": 1}) and not comm.is_shardable(3)
    assert comm.concat([torch.ones(1), torch.zeros(2)]).tolist() == [1.0, 0.0, 0.0]
    assert comm.concat([["a"], ["b", "c"]]) == ["a", "b", "c"]
