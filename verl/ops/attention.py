"""One decode step's attention on CPU: the G query heads that share a key/value head against a cache view.

    out = decode_attention(q, k, v, mask)      # q [B, H, G, d]; k, v [B, H, T, d]; mask bool [B, T] -> [B, H, G, d]
    # = softmax(q k^T / sqrt(d) over the positions mask keeps) v, per row b and key/value head h

A decode step reads the whole key/value cache for a few multiply-adds per float, so its time is the time the cache
takes to stream from memory; SDPA's CPU kernel runs it as a small flash-attention problem well below that speed
(csrc/cpu/attention.cpp). k and v may be views of the first T columns of a larger preallocated cache (the strides
of rows, heads and positions are free; head_dim must be contiguous). Masked positions change nothing whatever they
hold (NaN included), so padding columns may be left uninitialised; a row with no valid position gives zeros. Kernels for
CPU and CUDA (the fast decoder calls it on CPU only: on a GPU it keeps SDPA's fused kernels); without the extension
the reference (SDPA) runs. Not differentiable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from verl import _extension
from verl.ops._backend import use_fused

__all__ = ["decode_attention", "decode_attention_ref"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    op = "decode_attention"
    if q.dim() != 4 or q.dtype != torch.float32:
        raise TypeError(f"{op}: `q` must be float32 [rows, kv_heads, queries_per_kv_head, head_dim], got "
                        f"{q.dtype} {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.dtype != torch.float32:
            raise TypeError(f"{op}: `{name}` must be float32 [rows, kv_heads, positions, head_dim], got "
                            f"{t.dtype} {tuple(t.shape)}")
        if (t.shape[0], t.shape[1], t.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
            raise ValueError(f"{op}: `{name}` {tuple(t.shape)} does not match `q` {tuple(q.shape)} in rows, kv_heads "
                             f"or head_dim")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{op}: `k` has {k.shape[2]} positions but `v` has {v.shape[2]}")
    if mask.dtype != torch.bool or tuple(mask.shape) != (q.shape[0], k.shape[2]):
        raise ValueError(f"{op}: `mask` must be bool [{q.shape[0]}, {k.shape[2]}] (rows, positions), got "
                         f"{mask.dtype} {tuple(mask.shape)}")


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """SDPA with the key mask broadcast over heads and queries; rows with no valid position give zeros."""
    _check(q, k, v, mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.masked_fill(~mask.any(-1)[:, None, None, None], 0.0)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q [B, H, G, d] float32 (each key/value head's G query heads), k, v [B, H, T, d], mask bool [B, T]:
    [B, H, G, d]. `scale` defaults to 1 / sqrt(d)."""
    _check(q, k, v, mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not use_fused("decode_attention", q):
        return decode_attention_ref(q, k, v, mask, scale)
    k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    return torch.ops.verl.decode_attention(q, k, v, mask, scale)


def _register() -> None:
    @torch.library.register_fake("verl::decode_attention")
    def _(q, k, v, mask, scale):
        torch._check(q.dim() == 4, lambda: "decode_attention: `q` must be [rows, kv_heads, queries, head_dim]")
        return torch.empty_like(q, memory_format=torch.contiguous_format)


if _extension.available() and hasattr(torch.ops.verl, "decode_attention"):
    _register()
