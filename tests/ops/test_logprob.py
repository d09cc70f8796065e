"""verl::logprob_entropy / linear_logprob_entropy: kernels against references, gradients, opcheck, compile.

Tolerances (vs the float64 reference evaluated on the same, already rounded, inputs):
- float64: 1e-10 (the kernels use std::exp and double accumulation there).
- float32: 2e-5 absolute per unit of logit scale (polynomial exp with ~1e-7 relative error, float blocks).
- bfloat16 from logits: same as float32 (the kernels upcast each element; nothing is rounded to 16 bits).
- bfloat16 fused with the LM head: the chunk GEMM rounds each logit to bfloat16 (as `h @ W.T` does in
  eager), in a different summation order than one big GEMM, so logits differ by ~1 bf16 ulp: 3e-2 absolute.
"""

from __future__ import annotations

import pytest
import torch

import verl.ops as O
from tests.conftest import devices, needs_ext
from verl import _extension

OPS = torch.ops.verl if _extension.available() else None


def sample_inputs(device, dtype=torch.float32):
    """(logits [N, V], labels [N], temperature) cases: odd sizes, ignored rows, strided rows, big logits."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=3.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    def lab(n, v, ignore_every=0):
        y = torch.randint(0, v, (n,), generator=g)
        if ignore_every:
            y[::ignore_every] = -100
        return y.to(device)

    cases = [(rnd(1, 1), lab(1, 1), 1.0), (rnd(3, 7), lab(3, 7), 1.0), (rnd(5, 1000), lab(5, 1000, 2), 0.7),
             (rnd(6, 1537), lab(6, 1537, 3), 1.3), (rnd(4, 2048, scale=40.0), lab(4, 2048), 1.0),
             (rnd(0, 11), lab(0, 11), 1.0)]
    wide = rnd(9, 530)
    cases.append((wide[:, :513], lab(9, 513, 4), 0.9))  # rows strided: read in place
    cases.append((rnd(600, 8).t(), lab(8, 600), 2.0))  # column-major: copied once
    masked = rnd(4, 300)
    masked[:, 100:200] = float("-inf")  # masked-out vocabulary entries
    cases.append((masked, lab(4, 100), 1.0))
    # Rows longer than the CPU kernel's 4096-float block: several blocks fold into one online softmax,
    # including a block that is entirely -inf and a row whose maximum sits in its last, partial block.
    long_rows = rnd(3, 9001)
    long_rows[:, 4096:8192] = float("-inf")
    long_rows[1, 8999] = 50.0
    cases.append((long_rows, lab(3, 4096), 1.1))
    return cases


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}[dtype]


def _ref64(logits, labels, t):
    return O.logprob_entropy_ref(logits.double(), labels, t)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_logprob_entropy_matches_reference(device, dtype):
    for x, y, t in sample_inputs(device, dtype):
        lp, ent, lse = OPS.logprob_entropy(x, y, t)
        assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        want_lp, want_ent = _ref64(x, y, t)
        scale = max(1.0, x[torch.isfinite(x)].abs().max().item() / t) if x.numel() else 1.0
        tol = _tol(dtype) * scale
        torch.testing.assert_close(lp.double(), want_lp, atol=tol, rtol=0)
        torch.testing.assert_close(ent.double(), want_ent, atol=tol, rtol=0)
        valid = y != -100
        want_lse = torch.logsumexp(x.double() / t, -1)
        torch.testing.assert_close(lse.double()[valid], want_lse[valid], atol=tol, rtol=0)
        assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all() and (lse[~valid] == 0).all()


def _linear_cases(device, dtype):
    g = torch.Generator().manual_seed(1)
    cases = []
    for n, h, v, cn, cv in [(7, 16, 100, 3, 37), (33, 24, 513, 8, 128), (5, 8, 64, 1024, 4096), (1, 4, 3, 1, 1)]:
        hid = (torch.randn(n, h, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
        w = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5).to(device=device, dtype=dtype)
        y = torch.randint(0, v, (n,), generator=g)
        y[1::3] = -100
        cases.append((hid, w, y.to(device), 0.8, cn, cv))
    return cases


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_linear_matches_reference(device, dtype):
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    for h, w, y, t, cn, cv in _linear_cases(device, dtype):
        lp, ent, lse = OPS.linear_logprob_entropy(h, w, y, t, -100, cn, cv)
        want_lp, want_ent = O.logprob_entropy_ref((h @ w.t()).double(), y, t)
        torch.testing.assert_close(lp.double(), want_lp, atol=tol, rtol=0)
        torch.testing.assert_close(ent.double(), want_ent, atol=tol, rtol=0)
        # The chunked op equals the logits op on the same logits (fp64: the same to rounding).
        if dtype == torch.float64:
            ref_ops = OPS.logprob_entropy(h @ w.t(), y, t)
            for a, b in zip((lp, ent, lse), ref_ops):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 37, generator=g, dtype=torch.float64).to(device).requires_grad_()
    y = torch.tensor([3, -100, 36, 0, 17], device=device)
    assert torch.autograd.gradcheck(lambda a: OPS.logprob_entropy(a, y, 0.7, -100), (x,))
    strided = torch.randn(5, 45, generator=g, dtype=torch.float64).to(device)[:, :37].requires_grad_()
    assert torch.autograd.gradcheck(lambda a: OPS.logprob_entropy(a, y, 1.0, -100), (strided,))
    h = torch.randn(5, 6, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(37, 6, generator=g, dtype=torch.float64).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: OPS.linear_logprob_entropy(a, b, y, 1.3, -100, 2, 8), (h, w))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference(device, dtype):
    g = torch.Generator().manual_seed(3)
    n, hd, v = 12, 16, 300
    x = torch.randn(n, v, generator=g).to(device=device, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    y[::4] = -100
    up_lp, up_ent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)

    def loss(fn, *args):
        lp, ent = fn(*args)
        return (lp.double() * up_lp.double() + ent.double() * up_ent.double()).sum()

    a, b = x.clone().requires_grad_(), x.double().requires_grad_()
    loss(lambda z: O.logprob_entropy(z, y, 0.9), a).backward()
    loss(lambda z: O.logprob_entropy_ref(z, y, 0.9), b).backward()
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    assert (a.grad[y == -100] == 0).all()

    h = torch.randn(n, hd, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, hd, generator=g) * 0.3).to(device=device, dtype=dtype)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.double().requires_grad_(), w.double().requires_grad_()
    loss(lambda p, q: O.linear_logprob_entropy(p, q, y, 0.9, chunk_n=5, chunk_v=64), h1, w1).backward()
    loss(lambda p, q: O.linear_logprob_entropy_ref(p, q, y, 0.9), h2, w2).backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(h1.grad.double(), h2.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w1.grad.double(), w2.grad, atol=tol, rtol=tol)
    assert (h1.grad[y == -100] == 0).all()  # ignored rows are skipped by the GEMMs, not just zeroed


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 50, generator=g).to(device).requires_grad_()
    y = torch.tensor([0, 49, -100, 7, 7, 20], device=device)
    h = torch.randn(6, 8, generator=g).to(device).requires_grad_()
    w = torch.randn(50, 8, generator=g).to(device).requires_grad_()
    lp, ent, lse = (t.detach() for t in OPS.logprob_entropy(x, y, 1.0, -100))
    gr = torch.randn(6, device=device)
    checks = [(OPS.logprob_entropy.default, (x, y, 0.8, -100)),
              (OPS.logprob_entropy_shard.default, (x.detach(), y, 1.0, 10, 100, -100)),
              (OPS.logprob_entropy_backward.default, (gr, gr, None, x.detach(), y, lse, ent, 1.0, 0, -100)),
              (OPS.linear_logprob_entropy.default, (h, w, y, 1.1, -100, 4, 16)),
              (OPS.linear_logprob_entropy_shard.default, (h.detach(), w.detach(), y, 1.0, 0, 64, -100, 4, 16)),
              (OPS.linear_logprob_entropy_backward.default,
               (gr, None, gr, h.detach(), w.detach(), y, lse, ent, 1.0, 0, -100, 4, 16))]
    for op, args in checks:
        torch.library.opcheck(op, args)


@needs_ext
def test_torch_compile_fullgraph():
    def loss(x, h, w, y):
        lp, ent = O.logprob_entropy(x, y, temperature=0.9)
        lp2, ent2 = O.linear_logprob_entropy(h, w, y, chunk_n=4, chunk_v=32)
        return (lp * 2 + ent).sum() + (lp2 - 0.1 * ent2).mean()

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 100, generator=g, requires_grad=True)
    h = torch.randn(2, 6, 12, generator=g, requires_grad=True)
    w = torch.randn(100, 12, generator=g, requires_grad=True)
    y = torch.randint(0, 100, (2, 6), generator=g)
    y[0, 0] = -100
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(x, h, w, y)
    grads = torch.autograd.grad(got, (x, h, w))
    want = loss(x, h, w, y)
    wants = torch.autograd.grad(want, (x, h, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b)


@needs_ext
def test_leading_dims_and_backend_switch():
    x = torch.randn(2, 3, 40, dtype=torch.float64)
    y = torch.randint(0, 40, (2, 3))
    lp, ent = O.logprob_entropy(x, y)
    assert lp.shape == (2, 3) and ent.shape == (2, 3)
    with O.backend("reference"):
        lp_r, ent_r = O.logprob_entropy(x, y)
    torch.testing.assert_close(lp, lp_r)
    torch.testing.assert_close(ent, ent_r)
    # Entropy is bounded by log V and reaches it for uniform logits.
    u, _ = O.logprob_entropy(torch.zeros(1, 40, dtype=torch.float64), torch.tensor([5]))
    assert abs(u.item() + torch.log(torch.tensor(40.0, dtype=torch.float64)).item()) < 1e-12
    assert (ent <= torch.log(torch.tensor(40.0)) + 1e-9).all()


@needs_ext
def test_bad_inputs_name_the_argument():
    x, y = torch.randn(3, 10), torch.tensor([1, 2, 3])
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(RuntimeError, match=r"`labels`\[1\] = 10 is outside the vocabulary \[0, 10\)"):
        OPS.logprob_entropy(x, torch.tensor([1, 10, 3]), 1.0, -100)
    with pytest.raises(RuntimeError, match=r"`labels`\[0\] = -1 is outside"):
        OPS.linear_logprob_entropy(h, w, torch.tensor([-1, 0, 0]), 1.0, -100, 2, 2)
    with pytest.raises(RuntimeError, match=r"`labels` has 2 entries but `logits` has N=3"):
        OPS.logprob_entropy(x, torch.tensor([1, 2]), 1.0, -100)
    with pytest.raises(RuntimeError, match=r"`weight` has dtype Double but `hidden` has Float"):
        OPS.linear_logprob_entropy(h, w.double(), y, 1.0, -100, 2, 2)
    with pytest.raises(RuntimeError, match=r"`temperature` must be a finite number > 0, got 0"):
        OPS.logprob_entropy(x, y, 0.0, -100)
    with pytest.raises(RuntimeError, match=r"`temperature` must be a finite number > 0, got -1"):
        OPS.linear_logprob_entropy(h, w, y, -1.0, -100, 2, 2)
    with pytest.raises(RuntimeError, match=r"`logits` must be a floating-point tensor"):
        OPS.logprob_entropy(torch.ones(3, 10, dtype=torch.int64), y, 1.0, -100)
    with pytest.raises(RuntimeError, match=r"`weight` \[V, H\] has H=5 but `hidden` \[N, H\] has H=4"):
        OPS.linear_logprob_entropy(h, torch.randn(10, 5), y, 1.0, -100, 2, 2)
    with pytest.raises(RuntimeError, match=r"`chunk_v` must be > 0"):
        OPS.linear_logprob_entropy(h, w, y, 1.0, -100, 2, 0)
    with pytest.raises(RuntimeError, match=r"does not fit in the vocabulary"):
        OPS.logprob_entropy_shard(x, y, 1.0, 5, 12, -100)
    # The Python wrappers (either backend) give the same kind of message.
    for mode in ("auto", "reference"):
        with O.backend(mode):
            with pytest.raises((ValueError, RuntimeError), match=r"`temperature`"):
                O.logprob_entropy(x, y, temperature=-0.5)
            with pytest.raises((ValueError, RuntimeError), match=r"`labels`"):
                O.logprob_entropy(x, torch.tensor([1, 2]))
            with pytest.raises((TypeError, RuntimeError), match=r"`weight` has dtype"):
                O.linear_logprob_entropy(h, w.bfloat16(), y)
            with pytest.raises((ValueError, RuntimeError), match=r"is outside the vocabulary"):
                O.logprob_entropy(x, torch.tensor([0, 99, 0]))


@needs_ext
def test_all_ignored_rows_give_zero_and_no_gradient():
    x = torch.randn(4, 30, requires_grad=True)
    y = torch.full((4,), -7)
    lp, ent = O.logprob_entropy(x, y, ignore_index=-7)
    (lp.sum() + ent.sum()).backward()
    assert (lp == 0).all() and (ent == 0).all() and (x.grad == 0).all()
    h, w = torch.randn(4, 5, requires_grad=True), torch.randn(30, 5, requires_grad=True)
    lp, ent = O.linear_logprob_entropy(h, w, y, ignore_index=-7)
    (lp.sum() + ent.sum()).backward()
    assert (h.grad == 0).all() and (w.grad == 0).all()
