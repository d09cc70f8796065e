"""The vocabulary padding of a megatron model's output shards (its vocabulary is padded to a multiple of TP).

Log-probs and entropy of vocab-parallel logits are `verl.ops.vocab_parallel_logprob_entropy` (the one path: the
fused kernels, or their pure-PyTorch references); this module only masks the padding columns first.
"""

from __future__ import annotations

import torch

PAD_LOGIT = -1e9
"""Logit given to vocabulary padding columns: exp() is exactly 0 and p*x stays finite for any temperature."""


def masked_vocab_logits(logits: torch.Tensor, model) -> torch.Tensor:
    """Float32 logits with the vocabulary padding columns (on the last TP ranks) set to PAD_LOGIT."""
    logits = logits.float()
    v, vp, tp = model.arch.vocab_size, model.layout.padded_vocab_size, model.pg.tp_size
    if vp == v:
        return logits
    n = vp // tp
    start = model.pg.tp_rank * n
    pad_from = max(0, v - start)
    if pad_from >= n:
        return logits
    keep = torch.arange(n, device=logits.device) < pad_from
    return logits.masked_fill(~keep, PAD_LOGIT)
