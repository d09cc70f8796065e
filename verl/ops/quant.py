"""int8 weight-only linear layers for generation: the weights stream from memory as int8, the math stays float32.

    qweight, scale = quantize_int8(weight)                 # weight [N, K] -> int8 [N, K], float32 [N]
    y = int8_linear(x, qweight, scale, bias)               # x [..., K] float32 -> [..., N]
    # = x @ (qweight * scale[:, None]).T + bias, with the scale applied once per output

Quantization is symmetric per output row: scale = max|w_row| / 127, q = round(w / scale) in [-127, 127] (an
all-zero row gets scale 1 and q = 0). Only the weights are rounded: activations, accumulation and outputs are
float32, which is why a weight-only int8 model keeps its log-probs close to the float32 model's (SmolLM2-135M:
mean per-token KL ~3e-3), where dynamic int8 activations (torch's fbgemm linear_dynamic) move them by a KL
~0.4. Decoding reads every weight once per generated token for a handful of rows, so its speed is the speed
the weights stream at; reading a quarter of the bytes is the gain (csrc/cpu/int8_linear.cpp). Not
differentiable: the trained copy stays full precision, and the rollout correction (algorithm.rollout_correction)
accounts for the sampling distribution's difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg

__all__ = ["quantize_int8", "int8_linear", "int8_linear_ref"]


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [N, K], scale float32 [N]) of a [N, K] weight, symmetric per output row."""
    check_arg(weight.dim() == 2, "quantize_int8", f"`weight` must be [out_features, in_features], got shape "
                                                  f"{tuple(weight.shape)}")
    check_arg(weight.is_floating_point(), "quantize_int8", f"`weight` must be floating point, got {weight.dtype}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    check_arg(bool(torch.isfinite(amax).all()), "quantize_int8", "`weight` holds NaN or inf")
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def _check(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "int8_linear"
    check_arg(x.dim() >= 1, op, "`x` must have at least one dimension (features last)")
    if x.dtype != torch.float32:
        raise TypeError(f"{op}: `x` must be float32, got {x.dtype}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise TypeError(f"{op}: `qweight` must be int8 [out_features, in_features], got {qweight.dtype} "
                        f"{tuple(qweight.shape)}")
    check_arg(qweight.shape[1] == x.shape[-1], op, f"`qweight` has {qweight.shape[1]} in_features but `x` has "
                                                   f"{x.shape[-1]}")
    check_arg(scale.dtype == torch.float32 and tuple(scale.shape) == (qweight.shape[0],), op,
              f"`scale` must be float32 [{qweight.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None:
        check_arg(bias.dtype == torch.float32 and tuple(bias.shape) == (qweight.shape[0],), op,
                  f"`bias` must be float32 [{qweight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("scale", scale), ("bias", bias)):
        check_arg(t is None or t.device == x.device, op, f"`{name}` is on {t.device if t is not None else ''} but "
                                                         f"`x` is on {x.device}; move both to one device")


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Eager PyTorch: the float32 product with the int8 values, scaled per output afterwards (the kernel's order)."""
    _check(x, qweight, scale, bias)
    out = F.linear(x, qweight.to(x.dtype)) * scale
    return out if bias is None else out + bias


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 times the int8 weight [N, K] with per-row `scale` [N] (+ bias [N]): [..., N]."""
    _check(x, qweight, scale, bias)
    if not use_fused("int8_linear", x):
        return int8_linear_ref(x, qweight, scale, bias)
    lead = x.shape[:-1]
    out = torch.ops.verl.int8_linear(x.reshape(-1, x.shape[-1]), qweight, scale, bias)
    return out.view(*lead, qweight.shape[0])


def _register() -> None:
    @torch.library.register_fake("verl::int8_linear")
    def _(x, qweight, scale, bias):
        torch._check(x.dim() == 2, lambda: "int8_linear: `x` must be [rows, in_features]")
        torch._check(qweight.shape[1] == x.shape[1], lambda: "int8_linear: `qweight` and `x` disagree on in_features")
        return x.new_empty([x.shape[0], qweight.shape[0]])


if _extension.available() and hasattr(torch.ops.verl, "int8_linear"):
    _register()
