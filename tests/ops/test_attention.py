"""verl::decode_attention (one decode step's attention on CPU): the kernel against the SDPA reference over
grouped-query shapes (1..5 queries per key/value head; head_dim a multiple of 32, of 8 only, and of neither;
position counts with and without an 8-key tail), masks with padding, holes and no valid position, views of a
larger cache, NaN in masked cache columns; opcheck, torch.compile, and errors that name the bad argument."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import devices, needs_ext
from verl.ops import backend
from verl.ops.attention import decode_attention, decode_attention_ref


def sample_inputs(seed: int = 0):
    """(q, k, v, mask): k and v are views of the first T columns of a cache with room for T + 5."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for B, H, G, d, T in [(1, 1, 1, 8, 1), (2, 3, 3, 64, 180), (3, 2, 1, 32, 17), (2, 1, 5, 12, 9),
                          (4, 2, 2, 80, 40), (1, 4, 4, 16, 8), (2, 1, 3, 128, 33)]:
        q = torch.randn(B, H, G, d, generator=g)
        k = torch.randn(B, H, T + 5, d, generator=g)[:, :, :T]
        v = torch.randn(B, H, T + 5, d, generator=g)[:, :, :T]
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, : T // 3] = False  # left padding
        if B > 1:
            mask[1, T // 2:: 3] = False  # holes (a finished row's later positions, a joined row's padding)
        if B > 2:
            mask[2] = False
            mask[2, T - 1] = True  # one valid position
        cases.append((q, k, v, mask))
    return cases


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_kernel_matches_reference(device):
    for q, k, v, mask in sample_inputs():
        q, k, v, mask = (t.to(device) for t in (q, k, v, mask))
        want = decode_attention_ref(q, k, v, mask)
        with backend("fused"):
            got = decode_attention(q, k, v, mask)
        assert got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=str(tuple(k.shape)))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_masked_positions_change_nothing_whatever_they_hold(device):
    q, k, v, mask = (t.to(device) for t in sample_inputs()[1])
    want = decode_attention_ref(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :].expand(-1, k.shape[1], -1)] = float("nan")
    v2[~mask[:, None, :].expand(-1, v.shape[1], -1)] = float("inf")
    with backend("fused"):
        got = decode_attention(q, k2, v2, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_a_row_with_no_valid_position_gives_zeros(device):
    q, k, v, mask = (t.to(device) for t in sample_inputs()[2])
    mask = mask.clone()
    mask[1] = False
    with backend("fused"):
        got = decode_attention(q, k, v, mask)
    assert bool((got[1] == 0).all()) and bool(got[0].abs().sum() > 0)
    assert bool((decode_attention_ref(q, k, v, mask)[1] == 0).all())


@needs_ext
def test_the_scale_is_applied():
    q, k, v, mask = sample_inputs()[4]
    with backend("fused"):
        got = decode_attention(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, mask, scale=0.3), rtol=1e-5, atol=2e-6)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for q, k, v, mask in sample_inputs()[:4]:
        q, k, v, mask = (t.to(device) for t in (q, k, v, mask))
        torch.library.opcheck(torch.ops.verl.decode_attention.default, (q, k, v, mask, 0.125))


@needs_ext
def test_torch_compile_fullgraph():
    q, k, v, mask = sample_inputs()[3]
    fn = torch.compile(lambda q: decode_attention(q * 2, k, v, mask).sum(-1), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q), decode_attention_ref(q * 2, k, v, mask).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", [decode_attention, decode_attention_ref])
def test_errors_name_the_argument(impl):
    q, k, v, mask = (t.clone() for t in sample_inputs()[2])
    with pytest.raises(TypeError, match="`q` must be float32"):
        impl(q.double(), k, v, mask)
    with pytest.raises(TypeError, match="`v` must be float32"):
        impl(q, k, v[0], mask)
    with pytest.raises(ValueError, match="`k` .* does not match `q`"):
        impl(q, k[:, :1], v, mask)
    with pytest.raises(ValueError, match="`k` has 17 positions but `v` has 16"):
        impl(q, k, v[:, :, :16], mask)
    with pytest.raises(ValueError, match="`mask` must be bool \\[3, 17\\]"):
        impl(q, k, v, mask.long())


@needs_ext
def test_the_op_refuses_a_strided_head_dim():
    q, k, v, mask = sample_inputs()[2]
    with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
        torch.ops.verl.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, mask, 0.1)
