"""verl::reshard_{pack,unpack,gather}: kernels against references (bit-exact, every dtype), Megatron QKV
and gate/up permutations, opcheck, torch.compile, and argument errors."""

from __future__ import annotations

import pytest
import torch

import verl.ops as O
from tests.conftest import devices, needs_ext

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64]


def _rand(shape, dtype, device, g):
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    return x.to(dtype).to(device)


def sample_inputs(device, dtype=torch.float32):
    """(sources, plan, dim, out_shape) gather cases: one block, many blocks, dim 0/1/2, reversed order."""
    g = torch.Generator().manual_seed(0)
    a, b = _rand((6, 5), dtype, device, g), _rand((4, 5), dtype, device, g)
    c = _rand((3, 7, 2), dtype, device, g)
    cases = [
        ([a], torch.tensor([[0, 0, 0, 6]]), 0, (6, 5)),
        ([a, b], torch.tensor([[1, 0, 0, 4], [0, 2, 4, 3]]), 0, (7, 5)),
        ([a, b], torch.tensor([[0, 5, 0, 1], [1, 1, 1, 2], [0, 0, 3, 2]]), 0, (5, 5)),
        ([a.t().contiguous(), b.t()], torch.tensor([[0, 0, 0, 6], [1, 0, 6, 4]]), 1, (5, 10)),  # non-contiguous
        ([c, c], torch.tensor([[0, 1, 1, 6], [1, 0, 0, 1]]), 1, (3, 7, 2)),
        ([c], torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]]), 2, (3, 7, 2)),
    ]
    return cases


def megatron_qkv(q, k, v, groups, tp):
    """megatron-core's fused QKV split over TP ranks: per group [q heads of the group, k, v]."""
    hd = k.shape[0] // groups
    fused = torch.cat([q.reshape(groups, -1, q.shape[1]), k.reshape(groups, hd, -1), v.reshape(groups, hd, -1)], 1)
    return list(fused.reshape(-1, q.shape[1]).chunk(tp))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_reference_bit_exactly(device, dtype):
    for sources, plan, dim, shape in sample_inputs(device, dtype):
        got = torch.ops.verl.reshard_gather(sources, plan, dim, list(shape))
        want = O.reshard_gather_ref(sources, plan, dim, shape)
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_round_trip(device, dtype):
    g = torch.Generator().manual_seed(1)
    ts = [_rand(s, dtype, device, g) for s in [(3, 4), (7,), (2, 3, 5), (1,), (0, 4)]]
    ts.append(_rand((6, 8), dtype, device, g)[:, 1:5])  # a strided slice, packed without a temporary copy
    flat = torch.ops.verl.reshard_pack(ts)
    assert torch.equal(flat, O.reshard_pack_ref(ts))
    shapes = [t.shape for t in ts]
    outs = O.reshard_unpack(flat, shapes)
    assert all(torch.equal(o, t) and o.is_contiguous() for o, t in zip(outs, ts))
    assert all(o.data_ptr() != flat.data_ptr() for o in outs if o.numel())
    assert all(torch.equal(o, t) for o, t in zip(O.reshard_unpack_ref(flat, shapes), ts))


@needs_ext
@pytest.mark.parametrize("tp,tp_g", [(1, 1), (2, 1), (4, 2), (2, 2), (1, 4), (2, 8)])
def test_megatron_qkv_to_engine_layouts(tp, tp_g):
    """Gather-and-permute Megatron's per-TP fused QKV into HF q/k/v and vLLM's qkv_proj per TP_g shard."""
    heads, groups, hd, hidden = 8, 4, 3, 5
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n * hd, hidden, generator=g).bfloat16() for n in (heads, groups, groups))
    shards = megatron_qkv(q, k, v, groups, tp)
    per_rank = groups // tp
    qg = heads // groups * hd  # q rows of one group

    def rows_of(name, start, n):  # blocks of `shards` holding rows [start, start+n) of q/k/v
        blocks = []
        for r in range(tp):
            for j in range(per_rank):
                grp = r * per_rank + j
                base = j * (qg + 2 * hd)
                spans = {"q": (grp * qg, base, qg), "k": (grp * hd, base + qg, hd), "v": (grp * hd, base + qg + hd, hd)}
                hs, local, ln = spans[name]
                lo, hi = max(start, hs), min(start + n, hs + ln)
                if lo < hi:
                    blocks.append((r, local + lo - hs, lo - start, hi - lo))
        return blocks

    for tg in range(tp_g):
        hq = heads // tp_g
        kv0, nkv = tg * groups // tp_g, max(1, groups // tp_g)  # one replicated KV head when tp_g > groups
        parts = [("q", tg * hq * hd, hq * hd), ("k", kv0 * hd, nkv * hd), ("v", kv0 * hd, nkv * hd)]
        rows, off = [], 0
        for name, start, n in parts:
            rows += [(r, s, off + o, ln) for r, s, o, ln in rows_of(name, start, n)]
            off += n
        fused = O.reshard_gather(shards, torch.tensor(rows), 0, (off, hidden))
        want = torch.cat([{"q": q, "k": k, "v": v}[n][s:s + ln] for n, s, ln in parts])
        assert torch.equal(fused, want)


@needs_ext
def test_gate_up_split_into_hf_tensors():
    F, hidden, tp = 12, 4, 3
    gate, up = torch.randn(F, hidden), torch.randn(F, hidden)
    shards = [torch.cat([gc, uc]) for gc, uc in zip(gate.chunk(tp), up.chunk(tp))]
    n = F // tp
    got_gate = O.reshard_gather(shards, torch.tensor([[r, 0, r * n, n] for r in range(tp)]), 0, (F, hidden))
    got_up = O.reshard_gather(shards, torch.tensor([[r, n, r * n, n] for r in range(tp)]), 0, (F, hidden))
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    g = torch.Generator().manual_seed(3)
    ts = [_rand((3, 4), torch.float32, device, g), _rand((5,), torch.float32, device, g)]
    torch.library.opcheck(torch.ops.verl.reshard_pack.default, (ts,))
    torch.library.opcheck(torch.ops.verl.reshard_unpack.default, (O.reshard_pack(ts), [3, 4, 5], [2, 1]))
    for sources, plan, dim, shape in sample_inputs(device)[:4]:
        torch.library.opcheck(torch.ops.verl.reshard_gather.default, (sources, plan, dim, list(shape)))


@needs_ext
def test_torch_compile_fullgraph():
    def bucket_roundtrip(a, b, plan):
        flat = O.reshard_pack([a, b])
        a2, b2 = O.reshard_unpack(flat, [(4, 3), (2, 3)])
        return O.reshard_gather([a2, b2], plan, 0, (6, 3)) * 2

    a, b = torch.randn(4, 3), torch.randn(2, 3)
    plan = torch.tensor([[1, 0, 0, 2], [0, 0, 2, 4]])
    got = torch.compile(bucket_roundtrip, fullgraph=True, backend="aot_eager")(a, b, plan)
    assert torch.equal(got, torch.cat([b, a]) * 2)


@needs_ext
def test_bad_inputs_name_the_argument():
    a = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="plan row 0 reads"):
        torch.ops.verl.reshard_gather([a], torch.tensor([[0, 2, 0, 4]]), 0, [4, 3])
    with pytest.raises(RuntimeError, match="no plan row writes out index 3"):
        torch.ops.verl.reshard_gather([a], torch.tensor([[0, 0, 0, 3]]), 0, [4, 3])
    with pytest.raises(RuntimeError, match="already wrote"):
        torch.ops.verl.reshard_gather([a], torch.tensor([[0, 0, 0, 4], [0, 0, 0, 1]]), 0, [4, 3])
    with pytest.raises(RuntimeError, match="differs from `out_shape`"):
        torch.ops.verl.reshard_gather([a], torch.tensor([[0, 0, 0, 4]]), 0, [4, 2])
    with pytest.raises(RuntimeError, match=r"`plan` must be an int64"):
        torch.ops.verl.reshard_gather([a], torch.tensor([[0, 0, 0]]), 0, [4, 3])
    with pytest.raises(RuntimeError, match=r"`tensors\[1\]` has dtype"):
        torch.ops.verl.reshard_pack([a, a.double()])
    with pytest.raises(RuntimeError, match="must describe the bucket exactly"):
        torch.ops.verl.reshard_unpack(torch.zeros(10), [3, 3], [2])
    with pytest.raises(ValueError, match="exactly once"):
        O.reshard_gather_ref([a], torch.tensor([[0, 0, 0, 3]]), 0, (4, 3))
