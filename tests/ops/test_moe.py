"""verl::moe_permute / moe_unpermute (mixture-of-experts token dispatch): kernels against the eager references,
megatron-core's order, gradients, opcheck, torch.compile, and errors that name the bad argument."""

from __future__ import annotations

import pytest
import torch

import verl.ops.moe as M
from tests.conftest import devices, needs_ext



def _ids(T, K, E, g):
    """K distinct experts per token, as a top-k router picks them."""
    return torch.rand(T, E, generator=g).argsort(-1)[:, :K]


def sample_inputs(device, dtype=torch.float32):
    """(hidden, expert_ids, probs, num_experts): shapes from one token to hundreds, K = 1..4, unused experts, int32
    ids, no probs, non-contiguous hidden, and tiles that cut an expert's rows (T*K > 256)."""
    g = torch.Generator().manual_seed(0)
    cases = []
    # H = 77: the CPU float rows' 32-wide loop, an 8-wide step and a 5-element tail
    for T, H, E, K in [(1, 8, 4, 1), (5, 3, 4, 2), (37, 16, 8, 2), (300, 24, 16, 4), (129, 5, 64, 2), (64, 12, 3, 3),
                       (33, 77, 6, 2)]:
        h = torch.randn(T, H, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        ids = _ids(T, K, E, g).to(device)
        p = torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), -1).to(device)
        cases += [(h, ids, p, E), (h, ids.int(), None, E)]
    skewed = torch.zeros(50, 2, dtype=torch.long)  # every token to experts 0 and 5 of 6: four experts unused
    skewed[:, 1] = 5
    cases.append((torch.randn(50, 7, generator=g).to(device=device, dtype=dtype), skewed.to(device), None, 6))
    nc = torch.randn(9, 20, generator=g).to(device=device, dtype=dtype).t()[:, :9]  # [20, 9], strided
    cases.append((nc, _ids(20, 2, 5, g).to(device), torch.rand(20, 2, generator=g).to(device), 5))
    cases.append((torch.randn(0, 4).to(device=device, dtype=dtype), torch.zeros(0, 2, dtype=torch.long, device=device),
                  None, 3))
    return cases


def _tol(dtype):
    return {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def megatron_order(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """megatron-core's `permute` order, written from its definition (routing map read expert-major): the token of
    each permuted row."""
    T = ids.shape[0]
    routing = torch.zeros(T, num_experts, dtype=torch.bool).scatter(1, ids.long().cpu(), True)
    return torch.arange(T).expand(num_experts, -1).masked_select(routing.T.contiguous())


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_permute_and_unpermute_match_reference(device, dtype):
    for h, ids, p, E in sample_inputs(device, dtype):
        got = torch.ops.verl.moe_permute(h, ids, p, E)
        want = M.moe_permute_ref(h, ids, p, E)
        assert torch.equal(got[0], want.permuted)                  # a gather: exact in every dtype
        assert torch.equal(got[2], want.dst_of) and torch.equal(got[3], want.tokens_per_expert)
        if p is not None:
            assert torch.equal(got[1], want.permuted_probs)
        y = got[0] * 3 - 1
        for w in (None, p):
            out = torch.ops.verl.moe_unpermute(y, got[2], w)
            ref = M.moe_unpermute_ref(y.double(), got[2], None if w is None else w.double())
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), ref, atol=_tol(dtype) * 8, rtol=_tol(dtype))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_order_is_megatron_cores_and_roundtrip_is_identity(device):
    for h, ids, _, E in sample_inputs(device):
        if not h.numel():
            continue
        got = M.moe_permute(h, ids, None, E)
        rows_token = torch.empty(ids.numel(), dtype=torch.long)
        rows_token[got.dst_of.reshape(-1).cpu()] = torch.arange(h.shape[0]).repeat_interleave(ids.shape[1])
        assert torch.equal(rows_token, megatron_order(ids, E))
        # unpermuting the permuted rows gives each token K times itself
        torch.testing.assert_close(M.moe_unpermute(got.permuted, got.dst_of), h * ids.shape[1])


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(11, 6, generator=g, dtype=torch.float64).to(device).requires_grad_()
    p = torch.rand(11, 3, generator=g, dtype=torch.float64).to(device).requires_grad_()
    ids = _ids(11, 3, 5, g).to(device)

    def permute(h, p):
        out = M.moe_permute(h, ids, p, 5)
        return out.permuted * out.permuted_probs[:, None]

    def roundtrip(h, p):
        out = M.moe_permute(h, ids, None, 5)
        return M.moe_unpermute(torch.tanh(out.permuted), out.dst_of, p)
    assert torch.autograd.gradcheck(permute, (h, p))
    assert torch.autograd.gradcheck(roundtrip, (h, p))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("H", [16, 77])  # 77: every loop of the CPU float rows (32-wide, 8-wide, tail)
def test_gradients_match_reference(device, H):
    g = torch.Generator().manual_seed(3)
    h0, p0 = torch.randn(40, H, generator=g).to(device), torch.rand(40, 2, generator=g).to(device)
    ids, up = _ids(40, 2, 8, g).to(device), torch.randn(40, H, generator=g).to(device)
    grads = []
    for permute, unpermute in ((M.moe_permute, M.moe_unpermute), (M.moe_permute_ref, M.moe_unpermute_ref)):
        h, p = h0.clone().requires_grad_(), p0.clone().requires_grad_()
        out = permute(h, ids, p, 8)
        y = torch.sigmoid(out.permuted) * out.permuted_probs[:, None]
        (unpermute(y, out.dst_of, p) * up).sum().backward()
        grads.append((h.grad, p.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(13, 5, generator=g).to(device).requires_grad_()
    p = torch.rand(13, 2, generator=g).to(device).requires_grad_()
    ids = _ids(13, 2, 4, g).to(device)
    permuted, _, dst_of, _ = torch.ops.verl.moe_permute(h.detach(), ids, None, 4)
    y = permuted.clone().requires_grad_()
    ops = torch.ops.verl
    checks = [(ops.moe_permute.default, (h, ids, p, 4)), (ops.moe_permute.default, (h, ids, None, 4)),
              (ops.moe_unpermute.default, (y, dst_of, p)), (ops.moe_unpermute.default, (y, dst_of, None)),
              (torch.ops.verl.moe_unpermute_backward.default, (torch.randn(13, 5, device=device), dst_of, p.detach(),
                                                               y.detach())),
              (torch.ops.verl.moe_unpermute_backward.default, (torch.randn(13, 5, device=device), dst_of, None, None))]
    for op, args in checks:
        torch.library.opcheck(op, args)


@needs_ext
def test_torch_compile_fullgraph():
    def layer(h, ids, p, w):
        out = M.moe_permute(h, ids, None, 4)
        return M.moe_unpermute(torch.relu(out.permuted @ w), out.dst_of, p).sum()

    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(24, 8, generator=g, requires_grad=True), torch.randn(8, 8, generator=g, requires_grad=True)
    p, ids = torch.rand(24, 2, generator=g, requires_grad=True), _ids(24, 2, 4, g)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(h, ids, p, w)
    got.backward()
    grads = [t.grad.clone() for t in (h, p, w)]
    for t in (h, p, w):
        t.grad = None
    want = layer(h, ids, p, w)
    want.backward()
    torch.testing.assert_close(got, want)
    for a, t in zip(grads, (h, p, w)):
        torch.testing.assert_close(a, t.grad)


@needs_ext
def test_bad_inputs_name_the_argument():
    h = torch.randn(4, 3)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 3]])
    with pytest.raises(RuntimeError, match=r"`expert_ids`\[3, 1\] = 3 is not an expert in \[0, 3\)"):
        torch.ops.verl.moe_permute(h, ids, None, 3)
    with pytest.raises(RuntimeError, match=r"`expert_ids` must be \[tokens, top_k\] with 4 tokens"):
        torch.ops.verl.moe_permute(h, ids[:3], None, 4)
    with pytest.raises(RuntimeError, match=r"`probs` must have the shape of `expert_ids`"):
        torch.ops.verl.moe_permute(h, ids, torch.rand(4, 3), 4)
    with pytest.raises(RuntimeError, match=r"`expert_ids` must be int64 or int32"):
        torch.ops.verl.moe_permute(h, ids.float(), None, 4)
    permuted, _, dst_of, _ = torch.ops.verl.moe_permute(h, ids, None, 4)
    with pytest.raises(RuntimeError, match=r"`dst_of` maps 8 .* `permuted` has 6 rows"):
        torch.ops.verl.moe_unpermute(permuted[:6], dst_of, None)
    with pytest.raises(ValueError, match=r"`expert_ids`\[3, 1\] = 3 is not an expert"):
        M.moe_permute_ref(h, ids, None, 3)


@needs_ext
def test_reference_backend_gives_the_same_rows():
    import verl.ops as O
    h, ids = torch.randn(30, 4), _ids(30, 2, 6, torch.Generator().manual_seed(6))
    with O.backend("reference"):
        ref = M.moe_permute(h, ids, None, 6)
    assert torch.equal(M.moe_permute(h, ids, None, 6).permuted, ref.permuted)
