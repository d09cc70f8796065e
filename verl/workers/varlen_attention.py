"""Per-sequence ("varlen") attention for packed rows without flash-attn: transformers' SDPA path would run a
packed row [1, T] through one block-diagonal [T, T] mask, which costs T² per layer however short the sequences
are; this runs `scaled_dot_product_attention(is_causal=True)` once per sequence of the row instead (Σ L² per
layer), and never builds a mask.

It is registered with transformers as the attention implementation `VARLEN` (`AttentionInterface`), with a
mask function (`AttentionMaskInterface`) that returns None, and reads the sequence boundaries from the
FlashAttentionKwargs `cu_seq_lens_q` / `cu_seq_lens_k` that a model's forward passes down to its attention
layers. `varlen_attention(module)` switches a model to it for the forward it wraps (verl/workers/packing.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from verl.errors import VerlConfigError

__all__ = ["VARLEN", "varlen_attention", "varlen_sdpa_attention", "varlen_unsupported"]

VARLEN = "verl_varlen"
"""The attention implementation's name in transformers' registries."""


def _bounds(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{VARLEN} attention: cu_seq_lens {bounds} must rise from 0 to the packed length {total}")
    return bounds


def _band(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[L, L] bool causal mask limited to the last `window` keys (transformers' sliding window: a query sees
    itself and window - 1 keys before it); None where `is_causal` alone is exact."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def varlen_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                          cu_seq_lens_k: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. query [1, H, T, D], key / value [1, Hkv, T, D] (grouped-query:
    H a multiple of Hkv); cu_seq_lens [n + 1] (host-side, so slicing needs no device sync) the sequences'
    boundaries. Returns [1, T, H, D], as transformers' SDPA integration does."""
    unsupported = {k: kwargs[k] for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None}
    if not getattr(module, "is_causal", True):
        unsupported["is_causal"] = False
    if attention_mask is not None or cu_seq_lens_q is None or unsupported or query.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention runs one packed row ([1, H, T, D], got {tuple(query.shape)}) of "
                         f"causal sequences from cu_seq_lens_q, with no attention mask "
                         f"(got {None if attention_mask is None else 'one'}) "
                         f"and no {sorted(unsupported) or 'soft-cap, sinks, position bias or non-causal layers'}; "
                         f"verl.workers.packing.check_varlen_attention decides when it applies")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{VARLEN} attention: cu_seq_lens_k differs from cu_seq_lens_q (self-attention only)")
    bounds = _bounds(cu_seq_lens_q, query.shape[2])
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    out = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        band = _band(end - start, sliding_window, query.device)
        out.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=band, dropout_p=dropout,
            is_causal=band is None, scale=scaling, enable_gqa=gqa))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function for `VARLEN`: the sequence boundaries come as cu_seq_lens, so no [T, T] mask is built."""
    return None


AttentionInterface.register(VARLEN, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN, _no_mask)


def varlen_unsupported(trunk: torch.nn.Module) -> str | None:
    """Why `VARLEN` cannot stand in for this model's SDPA / eager attention (None: it can): attention the
    per-sequence causal SDPA call does not compute, or a backward that would rerun the attention outside the
    forward that selected it (gradient checkpointing)."""
    config = getattr(trunk, "config", None)
    if getattr(config, "sub_configs", None):
        return f"it is a composite model ({', '.join(config.sub_configs)}), whose parts need not be causal"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped (attn_logit_softcapping)"
    if any(getattr(m, "sinks", None) is not None for m in trunk.modules()):
        return "its attention has sink logits"
    if getattr(trunk, "is_gradient_checkpointing", False):
        return "gradient checkpointing reruns its attention in the backward pass"
    return None


@contextmanager
def varlen_attention(trunk: torch.nn.Module) -> Iterator[None]:
    """Runs the Hugging Face model `trunk` with `VARLEN` attention inside the block (its config, shared by its
    attention layers, names the implementation each layer looks up per call), and its own afterwards. The
    backward of the forward run inside needs nothing from the config."""
    config = trunk.config
    previous = config._attn_implementation
    if previous is None or previous.startswith("flash_attention"):
        raise VerlConfigError(f"{VARLEN} attention replaces sdpa / eager attention, not {previous!r}")
    config._attn_implementation = VARLEN
    try:
        yield
    finally:
        config._attn_implementation = previous
