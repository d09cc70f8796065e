"""verl::packed_linear (float32 linear with a weight packed into panels of 16 rows, for decoding): packing's
layout, the kernel against F.linear over every row-block remainder (1..6 rows and more), partial last panels and
K without an 8-wide multiple, a row's result independent of the rows beside it and of the thread count, opcheck,
torch.compile, and errors that name the bad argument."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import devices, needs_ext
from verl.ops import backend
from verl.ops.packed_linear import pack_linear_weight, packed_linear, packed_linear_ref


def sample_inputs():
    g = torch.Generator().manual_seed(0)
    cases = []
    for M, N, K, with_bias in [(1, 1, 1, False), (2, 16, 8, True), (5, 17, 13, False), (6, 33, 64, True),
                               (7, 48, 100, False), (13, 50, 576, True), (32, 70, 37, False)]:
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g) if with_bias else None
        cases.append((torch.randn(M, K, generator=g), w, b))
    return cases


def test_packing_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = pack_linear_weight(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 3], w[19]) and bool((p[1, :, 4:] == 0).all())
    assert torch.equal(packed_linear_ref(torch.eye(3), p, None, 20), w.t())


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_kernel_matches_f_linear(device):
    for x, w, b in sample_inputs():
        x, w, b = (None if t is None else t.to(device) for t in (x, w, b))
        with backend("fused"):
            got = packed_linear(x, pack_linear_weight(w), b, w.shape[0])
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4, msg=str((x.shape, w.shape)))
    x, w, b = (t.to(device) for t in sample_inputs()[5])
    with backend("fused"):  # leading dimensions are flattened and restored
        got = packed_linear(x.view(13, 1, 576), pack_linear_weight(w), b, 50)
    torch.testing.assert_close(got, F.linear(x, w, b)[:, None], rtol=1e-5, atol=1e-4)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(device):
    x, w, b = (t.to(device) for t in sample_inputs()[5])
    x = torch.cat([x, x.flip(0), x[:6]])  # 32 rows
    p = pack_linear_weight(w)
    with backend("fused"):
        full = packed_linear(x, p, b, 50)
        for rows in range(1, 32):
            assert torch.equal(packed_linear(x[:rows], p, b, 50), full[:rows]), rows
        assert torch.equal(packed_linear(x[7:9], p, b, 50), full[7:9])
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(packed_linear(x, p, b, 50), full)
        finally:
            torch.set_num_threads(threads)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for x, w, b in sample_inputs()[:4]:
        x, w, b = (None if t is None else t.to(device) for t in (x, w, b))
        torch.library.opcheck(torch.ops.verl.packed_linear.default, (x, pack_linear_weight(w), b, w.shape[0]))


@needs_ext
def test_torch_compile_fullgraph():
    x, w, b = sample_inputs()[3]
    p = pack_linear_weight(w)
    fn = torch.compile(lambda x: torch.relu(packed_linear(x, p, b, 33)).sum(-1), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x), torch.relu(F.linear(x, w, b)).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", [packed_linear, packed_linear_ref])
def test_errors_name_the_argument(impl):
    w = torch.randn(20, 8)
    p = pack_linear_weight(w)
    with pytest.raises(TypeError, match="`x` must be float32"):
        impl(torch.randn(2, 8, dtype=torch.float64), p, None, 20)
    with pytest.raises(ValueError, match="`packed` has 8 in_features but `x` has 7"):
        impl(torch.randn(2, 7), p, None, 20)
    with pytest.raises(ValueError, match="out_features 33 does not fit `packed`'s 2 panels of 16"):
        impl(torch.randn(2, 8), p, None, 33)
    with pytest.raises(TypeError, match="`packed` must be float32 \\[ceil"):
        impl(torch.randn(2, 8), w, None, 20)
    with pytest.raises(ValueError, match="`bias` must be float32 \\[20\\]"):
        impl(torch.randn(2, 8), p, torch.zeros(5), 20)
    with pytest.raises(TypeError, match="pack_linear_weight: `weight` must be float32"):
        pack_linear_weight(w.double())
