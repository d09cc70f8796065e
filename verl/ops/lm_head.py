"""Log-prob and entropy of target tokens straight from hidden states and an LM head: the one function the
training engines and the torch engine's exact decoder share, so both compute the same numbers bit for bit."""

from __future__ import annotations

import torch

from verl.ops.logprob import linear_logprob_entropy, logprob_entropy

__all__ = ["FUSED_LM_HEAD_MIN_VOCAB", "lm_head_logprob_entropy", "lm_head_is_fused"]

# Below this vocabulary the [tokens, vocab] logits are small and one GEMM beats the chunked fused LM head.
FUSED_LM_HEAD_MIN_VOCAB = 4096


def lm_head_is_fused(lm_head: torch.nn.Linear) -> bool:
    """Whether `lm_head_logprob_entropy` takes the fused path (never stores [tokens, vocab] logits)."""
    return lm_head.bias is None and lm_head.weight.shape[0] >= FUSED_LM_HEAD_MIN_VOCAB


def lm_head_logprob_entropy(hidden: torch.Tensor, lm_head: torch.nn.Linear, targets: torch.Tensor,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy [..., ] from hidden states [..., H] and the LM head. For real vocabularies the
    fused kernel computes the logits chunk by chunk, so [tokens, vocab] logits are never stored whole."""
    if not lm_head_is_fused(lm_head):
        return logprob_entropy(lm_head(hidden), targets, temperature)
    return linear_logprob_entropy(hidden, lm_head.weight, targets, temperature)
