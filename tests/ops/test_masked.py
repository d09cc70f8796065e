"""verl::masked_{sum,mean,var,whiten}: kernels against references, gradients, opcheck, torch.compile."""

from __future__ import annotations

import warnings

import pytest
import torch

import verl.ops as O
from tests.conftest import devices, needs_ext
from verl import _extension



def sample_inputs(device, dtype=torch.float32):
    """(values, mask, dim) cases: several shapes, mask dtypes, layouts, and the all-masked edge case."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for shape in [(1,), (7,), (3, 5), (4, 33), (2, 3, 17), (64, 300)]:
        v = torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        m = (torch.rand(shape, generator=g) > 0.3).to(device)
        dims = [None] + list(range(len(shape))) + [-1]
        for d in dims:
            cases.append((v, m, d))
        cases.append((v, m.float(), None))                 # float mask
        cases.append((v, m.to(torch.int64), -1))           # integer mask
        cases.append((v, torch.zeros_like(m), None))       # nothing valid
    nc = torch.randn(40, 30, generator=g).to(device=device, dtype=dtype).t()  # non-contiguous
    cases.append((nc, (torch.rand(30, 40, generator=g) > 0.5).to(device), 0))
    return cases


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_reductions_match_reference(device, dtype):
    for v, m, d in sample_inputs(device, dtype):
        for fused, ref in [(torch.ops.verl.masked_sum, O.masked_sum_ref),
                           (torch.ops.verl.masked_mean, O.masked_mean_ref)]:
            got, want = fused(v, m, d), ref(v.double(), m, d)
            assert got.dtype == dtype and got.shape == want.shape
            scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
            torch.testing.assert_close(got.double(), want, atol=_tol(dtype) * scale * 4, rtol=_tol(dtype))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_var_and_whiten_match_reference(device, dtype):
    for v, m, _ in sample_inputs(device, dtype):
        for unbiased in (True, False):
            got = torch.ops.verl.masked_var(v, m, unbiased)
            torch.testing.assert_close(got.double(), O.masked_var_ref(v.double(), m, unbiased),
                                       atol=_tol(dtype) * 10, rtol=_tol(dtype) * 10)
        for shift in (True, False):
            got = torch.ops.verl.masked_whiten(v, m, shift, 1e-8)
            want = O.masked_whiten_ref(v.double(), m, shift, 1e-8)
            torch.testing.assert_close(got.double(), want, atol=_tol(dtype) * 20, rtol=_tol(dtype) * 10)


@needs_ext
def test_edge_cases_are_finite_and_documented():
    v = torch.randn(5, 4)
    none = torch.zeros(5, 4, dtype=torch.bool)
    assert O.masked_sum(v, none).item() == 0.0
    assert O.masked_mean(v, none).item() == 0.0
    assert torch.equal(O.masked_mean(v, none, dim=1), torch.zeros(5))
    assert O.masked_var(v, none).item() == 0.0
    assert torch.equal(O.masked_whiten(v, none), torch.zeros(5, 4))
    one = torch.zeros(5, 4, dtype=torch.bool)
    one[2, 1] = True
    assert O.masked_var(v, one).item() == 0.0           # n = 1: unbiased variance defined as 0
    assert torch.isfinite(O.masked_whiten(v, one)).all()
    empty = torch.empty(0, 3)
    assert O.masked_sum(empty, empty.bool()).item() == 0.0
    assert O.masked_mean(empty, empty.bool(), dim=1).shape == (0,)


@needs_ext
def test_whiten_gives_zero_mean_unit_variance_over_mask():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(32, 50, generator=g, dtype=torch.float64) * 3 + 5
    m = torch.rand(32, 50, generator=g) > 0.4
    w = O.masked_whiten(v, m)
    assert abs(O.masked_mean(w, m).item()) < 1e-10
    assert abs(O.masked_var(w, m).item() - 1.0) < 1e-6
    assert (w[~m] == 0).all()


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    g = torch.Generator().manual_seed(2)
    v = torch.randn(6, 9, generator=g, dtype=torch.float64).to(device).requires_grad_()
    m = (torch.rand(6, 9, generator=g) > 0.3).to(device)
    fns = [lambda x: torch.ops.verl.masked_sum(x, m, None), lambda x: torch.ops.verl.masked_sum(x, m, 0),
           lambda x: torch.ops.verl.masked_mean(x, m, -1), lambda x: torch.ops.verl.masked_mean(x, m, None),
           lambda x: torch.ops.verl.masked_var(x, m, True), lambda x: torch.ops.verl.masked_var(x, m, False),
           lambda x: torch.ops.verl.masked_whiten(x, m, True, 1e-8),
           lambda x: torch.ops.verl.masked_whiten(x, m, False, 1e-8)]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (v,))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradients_match_reference(device):
    v = torch.randn(8, 16, dtype=torch.float64, device=device)
    m = torch.rand(8, 16, device=device) > 0.5
    up = torch.randn(8, 16, dtype=torch.float64, device=device)
    for fused, ref in [(lambda x: O.masked_whiten(x, m) * up, lambda x: O.masked_whiten_ref(x, m) * up),
                       (lambda x: O.masked_mean(x, m, 1) * up[:, 0], lambda x: O.masked_mean_ref(x, m, 1) * up[:, 0])]:
        a = v.clone().requires_grad_()
        b = v.clone().requires_grad_()
        fused(a).sum().backward()
        ref(b).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    v = torch.randn(5, 7, dtype=torch.float32, device=device, requires_grad=True)
    m = torch.rand(5, 7, device=device) > 0.3
    checks = [(torch.ops.verl.masked_sum.default, (v, m, None)), (torch.ops.verl.masked_sum.default, (v, m, 1)),
              (torch.ops.verl.masked_mean.default, (v, m, 0)), (torch.ops.verl.masked_var.default, (v, m, True)),
              (torch.ops.verl.masked_whiten.default, (v, m, False, 1e-6)),
              (torch.ops.verl.masked_reduce_backward.default, (torch.randn(5, device=device), m, 1, True)),
              (torch.ops.verl.masked_var_backward.default, (torch.tensor(1.0, device=device), v.detach(), m, True)),
              (torch.ops.verl.masked_whiten_backward.default,
               (torch.randn(5, 7, device=device), v.detach(), m, True, 1e-8))]
    for op, args in checks:
        torch.library.opcheck(op, args)


@needs_ext
def test_torch_compile_fullgraph():
    def loss(x, m):
        adv = O.masked_whiten(x, m)
        return O.masked_mean(adv * x, m) + O.masked_sum(x, m, 1).sum() + O.masked_var(x, m)

    x = torch.randn(16, 24, requires_grad=True)
    m = torch.rand(16, 24) > 0.2
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(x, m)
    got.backward()
    g1 = x.grad.clone()
    x.grad = None
    want = loss(x, m)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g1, x.grad)


@needs_ext
def test_bad_inputs_name_the_argument():
    v = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"`mask` must have the shape of `values`"):
        torch.ops.verl.masked_sum(v, torch.ones(4, 3, dtype=torch.bool), None)
    with pytest.raises(RuntimeError, match=r"`values` must be a floating-point tensor"):
        torch.ops.verl.masked_mean(torch.ones(3, 4, dtype=torch.int64), torch.ones(3, 4), None)
    with pytest.raises(RuntimeError, match=r"`dim`=5 is out of range"):
        torch.ops.verl.masked_sum(v, torch.ones(3, 4), 5)
    with pytest.raises(RuntimeError, match=r"`eps` must be >= 0"):
        torch.ops.verl.masked_whiten(v, torch.ones(3, 4), True, -1.0)
    with pytest.raises(RuntimeError, match=r"`mask` must be bool or a real dtype"):
        torch.ops.verl.masked_sum(v, torch.ones(3, 4, dtype=torch.complex64), None)


def test_reference_backend_switch_and_fallback():
    v = torch.randn(4, 5, dtype=torch.float64)
    m = torch.rand(4, 5) > 0.5
    with O.backend("reference"):
        assert O.get_backend() == "reference"
        out = O.masked_whiten(v, m)
    assert O.get_backend() == "auto"
    torch.testing.assert_close(out, O.masked_whiten_ref(v, m))
    with pytest.raises(ValueError, match="unknown verl.ops backend 'fast'"):
        O.set_backend("fast")


def test_fallback_warns_once_and_names_build_command(monkeypatch):
    from verl.ops import _backend
    monkeypatch.setattr(_backend, "_KERNELS", {})          # as if verl._C were not built
    monkeypatch.setattr(_extension, "available", lambda: False)
    monkeypatch.setattr(_extension, "_warned", set())
    v, m = torch.randn(3, 3), torch.ones(3, 3, dtype=torch.bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        O.masked_sum(v, m)
        O.masked_mean(v, m)
    msgs = [str(w.message) for w in caught if "verl.ops" in str(w.message)]
    assert len(msgs) == 1 and "pip install --no-build-isolation -e ." in msgs[0]
    with O.backend("fused"), pytest.raises(RuntimeError, match="backend is 'fused'"):
        O.masked_sum(v, m)


@needs_ext
def test_dispatcher_has_cpu_kernels_for_every_op():
    ops = _extension.op_names()
    assert "masked_sum" in ops
    missing = [op for op in ops if not _extension.has_kernel(op, "CPU")]
    assert not missing, f"ops without a CPU kernel: {missing}"
