"""float32 linear layers for decoding on CPU, with the weight packed once into panels of 16 output rows.

    packed = pack_linear_weight(weight)                    # [N, K] -> [ceil(N / 16), K, 16], zero-padded
    y = packed_linear(x, packed, bias, N)                  # x [..., K] float32 -> [..., N] = F.linear(x, weight, bias)

A decode step multiplies a handful of rows by every weight of the model; `F.linear` repacks the weight at every call
and GEMM libraries tune for many rows. The panels make each block of 16 outputs one contiguous stream that a
register block of 6 rows x 16 outputs consumes with two vector loads and twelve FMAs per k (csrc/cpu/packed_linear.cpp);
the next panel is prefetched while the first row block runs. Every output is one FMA chain over k in order, so a
row's result is the same bit for bit whatever the number of rows beside it or the thread count. Kernels for CPU and
CUDA (the fast decoder packs only on CPU: on a GPU it keeps cuBLAS through F.linear); without the extension the
reference, `F.linear` on the unpacked weight, runs. Not differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl import _extension
from verl.ops._backend import use_fused

__all__ = ["pack_linear_weight", "packed_linear", "packed_linear_ref"]


@torch.no_grad()
def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 16), K, 16] with packed[p, k, j] = weight[16 p + j, k] (0 past row N)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise TypeError(f"pack_linear_weight: `weight` must be float32 [out_features, in_features], got "
                        f"{weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    P = (N + 15) // 16
    padded = weight.new_zeros(P * 16, K)
    padded[:N] = weight
    return padded.view(P, 16, K).transpose(1, 2).contiguous()


def _check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    op = "packed_linear"
    if x.dtype != torch.float32 or x.dim() < 1:
        raise TypeError(f"{op}: `x` must be float32 [..., in_features], got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.float32 or packed.dim() != 3 or packed.shape[2] != 16:
        raise TypeError(f"{op}: `packed` must be float32 [ceil(out_features / 16), in_features, 16] "
                        f"(pack_linear_weight), got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: `packed` has {packed.shape[1]} in_features but `x` has {x.shape[-1]}")
    if not 16 * (packed.shape[0] - 1) < n <= 16 * packed.shape[0]:
        raise ValueError(f"{op}: out_features {n} does not fit `packed`'s {packed.shape[0]} panels of 16")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"{op}: `bias` must be float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")


def packed_linear_ref(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """F.linear on the unpacked weight."""
    _check(x, packed, bias, n)
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]
    return F.linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [..., K] float32 times the packed weight of `n` outputs (+ bias [n]): [..., n]."""
    _check(x, packed, bias, n)
    if not use_fused("packed_linear", x):
        return packed_linear_ref(x, packed, bias, n)
    lead = x.shape[:-1]
    return torch.ops.verl.packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, n).view(*lead, n)


def _register() -> None:
    @torch.library.register_fake("verl::packed_linear")
    def _(x, packed, bias, n):
        torch._check(x.dim() == 2, lambda: "packed_linear: `x` must be [rows, in_features]")
        return x.new_empty([x.shape[0], n])


if _extension.available() and hasattr(torch.ops.verl, "packed_linear"):
    _register()
