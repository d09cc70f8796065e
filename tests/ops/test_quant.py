"""verl::int8_linear (int8 weight-only linear for generation): the kernel against the eager reference over decode
and prefill shapes (every AVX2 block remainder), quantization's bounds, opcheck, torch.compile, and errors that
name the bad argument."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import devices, needs_ext
from verl.ops import backend
from verl.ops.quant import int8_linear, int8_linear_ref, quantize_int8



def sample_inputs(device):
    """(x, qweight, scale, bias): M = 1..37 rows (4-row blocks and their 1-3 remainders), N = 1..50 (3-row blocks
    and remainders, several 12-row tasks), K with and without an 8-wide tail, bias or none, a 3-d x."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for M, N, K, with_bias in [(1, 1, 1, False), (1, 7, 8, True), (3, 5, 13, False), (4, 12, 16, True),
                               (5, 50, 67, True), (37, 25, 576, False), (8, 3, 9, True), (2, 48, 200, False)]:
        w = torch.randn(N, K, generator=g)
        q, s = quantize_int8(w)
        b = torch.randn(N, generator=g) if with_bias else None
        x = torch.randn(M, K, generator=g)
        cases.append((x.to(device), q.to(device), s.to(device), None if b is None else b.to(device)))
    w = torch.randn(10, 24, generator=g)
    q, s = quantize_int8(w)
    cases.append((torch.randn(2, 3, 24, generator=g).to(device), q.to(device), s.to(device), None))
    return cases


def test_quantize_int8_bounds_and_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 100, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    w[5] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all()) and float(s[5]) == 1.0
    # every row's largest magnitude maps to +-127; rounding moves an element by at most half a step
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6 * w.abs()).all())
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_kernel_matches_reference(device):
    for x, q, s, b in sample_inputs(device):
        want = int8_linear_ref(x, q, s, b)
        with backend("fused"):
            got = int8_linear(x, q, s, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_reference_is_the_dequantized_product():
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(30, 40, generator=g), torch.randn(6, 40, generator=g), torch.randn(30, generator=g)
    q, s = quantize_int8(w)
    want = torch.nn.functional.linear(x.double(), (q.double() * s.double()[:, None]), b.double()).float()
    torch.testing.assert_close(int8_linear_ref(x, q, s, b), want, rtol=1e-5, atol=1e-5)
    # weight-only: the output is close to the float32 layer's (per-row scales bound the rounding)
    rel = (int8_linear_ref(x, q, s) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < float(rel) < 0.02


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for x, q, s, b in sample_inputs(device)[:4]:
        torch.library.opcheck(torch.ops.verl.int8_linear.default, (x, q, s, b))


@needs_ext
def test_torch_compile_fullgraph():
    g = torch.Generator().manual_seed(3)
    q, s = quantize_int8(torch.randn(16, 32, generator=g))
    x = torch.randn(5, 32, generator=g)
    fn = torch.compile(lambda x: torch.relu(int8_linear(x, q, s)).sum(-1), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x), torch.relu(int8_linear_ref(x, q, s)).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", [int8_linear, int8_linear_ref])
def test_errors_name_the_argument(impl):
    q, s = quantize_int8(torch.randn(4, 8))
    with pytest.raises(TypeError, match="`x` must be float32"):
        impl(torch.randn(2, 8, dtype=torch.float64), q, s)
    with pytest.raises(ValueError, match="`qweight` has 8 in_features but `x` has 7"):
        impl(torch.randn(2, 7), q, s)
    with pytest.raises(ValueError, match="`scale` must be float32 \\[4\\]"):
        impl(torch.randn(2, 8), q, s[:3])
    with pytest.raises(TypeError, match="`qweight` must be int8"):
        impl(torch.randn(2, 8), q.float(), s)
    with pytest.raises(ValueError, match="`bias` must be float32 \\[4\\]"):
        impl(torch.randn(2, 8), q, s, torch.zeros(5))


@needs_ext
def test_avx2_path_matches_reference_too():
    """The kernel picks AVX-512 where the CPU has it; the AVX2 path (forced, in a process of its own: the choice is
    made once per process) must give the same sums."""
    import os
    import subprocess
    import sys
    code = ("import torch, verl.ops\n"
            "from tests.ops.test_quant import sample_inputs\n"
            "from verl.ops.quant import int8_linear, int8_linear_ref\n"
            "for x, q, s, b in sample_inputs('cpu'):\n"
            "    with verl.ops.backend('fused'):\n"
            "        got = int8_linear(x, q, s, b)\n"
            "    torch.testing.assert_close(got, int8_linear_ref(x, q, s, b), rtol=1e-5, atol=1e-4)\n"
            "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, VERL_INT8_NO_AVX512="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
