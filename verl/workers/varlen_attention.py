"""Per-sequence ("varlen") attention for packed rows without flash-attn: transformers' SDPA path would run a
packed row [1, T] through one block-diagonal [T, T] mask, which costs T² per layer however short the sequences
are; this runs `scaled_dot_product_attention(is_causal=True)` per sequence of the row instead (Σ L² per layer;
or, where that is cheaper, once over the sequences right-padded to the longest: `batch_sequences`), and never
builds a [T, T] mask.

It is registered with transformers as the attention implementation `VARLEN` (`AttentionInterface`), with a
mask function (`AttentionMaskInterface`) that returns None, and reads the sequence boundaries from the
FlashAttentionKwargs `cu_seq_lens_q` / `cu_seq_lens_k` that a model's forward passes down to its attention
layers. `varlen_attention(module)` switches a model to it for the forward it wraps (verl/workers/packing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from verl.errors import VerlConfigError

__all__ = ["VARLEN", "batch_sequences", "varlen_attention", "varlen_sdpa_attention", "varlen_unsupported"]

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
                          cu_seq_lens_k: torch.Tensor | None = None, verl_tree=None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. query [1, H, T, D], key / value [1, Hkv, T, D] (grouped-query:
    H a multiple of Hkv); cu_seq_lens [n + 1] (host-side, so slicing needs no device sync) the sequences'
    boundaries, or `verl_tree` the segments of a prefix tree (verl.workers.packing.pack_tree: each attends to its
    context and causally to itself). Returns [1, T, H, D], as transformers' SDPA integration does."""
    unsupported = {k: kwargs[k] for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None}
    if not getattr(module, "is_causal", True):
        unsupported["is_causal"] = False
    if verl_tree is not None and not unsupported and attention_mask is None and query.shape[0] == 1 \
            and sliding_window is None:
        return _tree_attention(module, query, key, value, verl_tree, dropout, scaling), None
    if attention_mask is not None or cu_seq_lens_q is None or unsupported or query.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention runs one packed row ([1, H, T, D], got {tuple(query.shape)}) of "
                         f"causal sequences from cu_seq_lens_q, with no attention mask "
                         f"(got {None if attention_mask is None else 'one'}) "
                         f"and no {sorted(unsupported) or 'soft-cap, sinks, position bias or non-causal layers'}; "
                         f"verl.workers.packing.check_varlen_attention decides when it applies")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{VARLEN} attention: cu_seq_lens_k differs from cu_seq_lens_q (self-attention only)")
    bounds = _bounds(cu_seq_lens_q, query.shape[2])
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout if module.training else 0.0,
                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if not spans:
        return query.transpose(1, 2).contiguous(), None
    longest = max(b - a for a, b in spans)
    if batch_sequences([b - a for a, b in spans]):
        return _batched(sdpa, query, key, value, spans, longest, sliding_window), None
    out = []
    for start, end in spans:
        band = _band(end - start, sliding_window, query.device)
        out.append(sdpa(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=band,
                        is_causal=band is None))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree,
                    dropout: float, scaling: float | None) -> torch.Tensor:
    """[1, T, H, D]: each tree segment's queries against its context's keys and its own (causal), one SDPA call per
    segment: Σ L·(A + L) per layer instead of the dense mask's T²."""
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout if module.training else 0.0,
                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    out = []
    for seg in tree:
        s, e = seg.start, seg.end
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        A = len(seg.context)
        if A == 0:
            out.append(sdpa(q, k, v, is_causal=True))
            continue
        k = torch.cat([key[:, :, seg.context], k], dim=2)
        v = torch.cat([value[:, :, seg.context], v], dim=2)
        mask = torch.ones(e - s, A + e - s, dtype=torch.bool, device=query.device).tril(diagonal=A)
        out.append(sdpa(q, k, v, attn_mask=mask))
    if not out:
        return query.transpose(1, 2).contiguous()
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def batch_sequences(lengths: list[int]) -> bool:
    """One SDPA call over the sequences right-padded to the longest (n·L_max² attention) rather than one call per
    sequence (Σ L², n calls): where that at most doubles the attention's work, the calls' fixed cost (Python,
    kernel launches) is the larger one for the short sequences of a packed micro-batch."""
    return len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths)


def _batched(sdpa, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[tuple[int, int]],
             longest: int, window: int | None) -> torch.Tensor:
    """[1, T, H, D]: the sequences gathered into [n, H, L_max, D] rows, right-padded with whatever tokens follow
    them (a causal query at a real position never sees a key after it, so the filler only reaches padding
    queries, whose outputs, and so gradients, are dropped)."""
    device, T = query.device, query.shape[2]
    starts = torch.tensor([a for a, _ in spans], device=device)
    lengths = torch.tensor([b - a for a, b in spans], device=device)
    offsets = torch.arange(longest, device=device)
    index = (starts[:, None] + offsets).clamp(max=T - 1)
    rows = [x[0][:, index].transpose(0, 1) for x in (query, key, value)]  # [n, heads, L_max, D]
    band = _band(longest, window, device)
    out = sdpa(*rows, attn_mask=band, is_causal=band is None)
    return out.transpose(1, 2)[offsets < lengths[:, None]][None].contiguous()


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
