"""Log-prob and entropy from vocab-parallel logits (each TP rank holds a column slice of the vocabulary).

`vocab_parallel_logprob_entropy` uses `verl.ops.vocab_parallel_logprob_entropy` (the fused kernel family) when
it exists, and the pure-PyTorch reference below otherwise; both take
``(logits_shard [..., V/tp], labels [...], temperature, group, ignore_index=-100) -> (log_prob, entropy)``.

The reference never gathers the vocabulary: max, sum-exp, the target logit and sum p*x are each reduced over
TP. Backward is local (each rank owns the grads of its columns):
``d logp_y / dx = (onehot_y - p) / T`` and ``d H / dx = -p (x - E_p[x]) / T`` with x = logits / T.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, group, ignore_index):
        x = logits.float() / temperature
        n = x.shape[-1]
        rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
        start = rank * n
        m = x.max(dim=-1, keepdim=True).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m)
        sum_e = e.sum(dim=-1, keepdim=True)
        local = (labels >= start) & (labels < start + n)
        idx = (labels - start).clamp(0, n - 1)
        tgt = torch.gather(x, -1, idx.unsqueeze(-1)).squeeze(-1) * local
        sum_ex = (e * x).sum(dim=-1, keepdim=True)
        packed = torch.cat([sum_e, sum_ex, tgt.unsqueeze(-1)], dim=-1)
        if group is not None:
            dist.all_reduce(packed, group=group)
        sum_e, sum_ex, tgt = packed[..., 0:1], packed[..., 1:2], packed[..., 2]
        lse = (m + torch.log(sum_e)).squeeze(-1)
        ex = (sum_ex / sum_e).squeeze(-1)  # E_p[x]
        valid = labels != ignore_index
        logp = torch.where(valid, tgt - lse, torch.zeros_like(lse))
        entropy = lse - ex
        ctx.save_for_backward(x, m, sum_e, ex.unsqueeze(-1), idx, local & valid)
        ctx.temperature = temperature
        ctx.valid = valid
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, m, sum_e, ex, idx, hit = ctx.saved_tensors
        p = torch.exp(x - m) / sum_e
        grad = torch.zeros_like(x)
        if g_logp is not None:
            g = (g_logp * ctx.valid).unsqueeze(-1)
            grad -= g * p
            grad.scatter_add_(-1, idx.unsqueeze(-1), (g.squeeze(-1) * hit).unsqueeze(-1))
        if g_ent is not None:
            grad -= g_ent.unsqueeze(-1) * p * (x - ex)
        return grad / ctx.temperature, None, None, None, None


def vocab_parallel_logprob_entropy_ref(logits_shard: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                                       group=None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: log p(label) and entropy of softmax(logits / T) over the TP-sharded vocabulary, float32.

    Ignored labels give log-prob 0 (entropy is still computed). `group=None` means an unsharded vocabulary.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} disagree on the "
                         f"leading dims")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelLogprobEntropy.apply(logits_shard, labels, float(temperature), group, ignore_index)


def vocab_parallel_logprob_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, temperature: float, group,
                                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op from `verl.ops` when available, else the reference (same signature and semantics)."""
    import verl.ops
    fused = getattr(verl.ops, "vocab_parallel_logprob_entropy", None)
    if fused is not None:
        return fused(logits_shard, labels, temperature, group, ignore_index=ignore_index)
    return vocab_parallel_logprob_entropy_ref(logits_shard, labels, temperature, group, ignore_index=ignore_index)
