"""The fused RL loss head: hidden states and the LM head weight straight to the actor's scalar loss.

    out = verl.ops.linear_rl_loss(hidden, lm_head.weight, responses, response_mask, advantages,
                                  old_logprob=old, ref_logprob=ref, temperature=1.0, loss_type="vanilla",
                                  clip_low=0.2, clip_high=0.28, kl_kind="low_var_kl", kl_coef=0.001,
                                  entropy_coeff=0.0, agg=Aggregation(...))
    out.loss.backward()          # d loss / d hidden and d loss / d weight were computed in the forward
    out.log_probs, out.entropy   # [B, T], detached; out.pg_clipfrac, out.ppo_kl, ... 0-d statistics

loss = policy_loss(logprob) - entropy_coeff * agg(entropy) + kl_coef * kl_loss(logprob, ref_logprob), exactly
`verl.algos.actor_loss` on `linear_logprob_entropy(hidden, weight, labels, temperature)` for the policy losses in
HEAD_LOSSES (vanilla PPO clip with dual clip, gspo, reinforce) and every KL kind in verl.ops.KL_KINDS.
old_logprob=None is the on-policy shortcut (old = this forward's log-probs, detached); ref_logprob=None: no KL.
Tokens where the mask is 0 are skipped (log-prob and entropy 0, no gradient, their labels never read).

Why it is fast (csrc/include/verl/rl_head.h): every input of the gradient except the row's log-sum-exp is known
before the op runs, so chunk by chunk (rows x the whole vocabulary) the kernel computes the logits (GEMM 1),
log-prob / entropy / loss / d loss / d logits in two streaming passes over the chunk, then grad_hidden (GEMM 2)
and grad_weight (GEMM 3). Forward + backward is 3 GEMMs (2 for a head that does not require grad: LoRA's), the
[N, V] logits are never whole (one [rows, V] buffer), and the backward op only scales the saved gradients by
grad_output. The gradients cost one [N, H] and one [V, H] tensor until backward, the same as autograd's; beyond
them the op holds one [rows, V] logits chunk and, when some tokens are masked, one [rows, H] buffer of the
chunk's gathered hidden rows (never a copy of all of hidden).

Vocab parallel (`vocab_parallel_linear_rl_loss`): each tensor-parallel rank holds Megatron's contiguous slice of
the LM head rows; per chunk of whole sequences, each rank reduces its slice, two small all-reduces (max, then sum
of [3, rows]) combine the slices into the row's log-prob and entropy, the per-token loss terms run on every rank
alike, and each rank forms its slice's d loss / d logits. grad_weight_shard is local; grad_hidden is summed over
the group. Still 3 GEMMs, composed of the log-prob family's shard ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_floating, check_name, check_same_device, check_same_shape
from verl.ops.logprob import _check_linear, _check_temperature, _combine, _group_layout, _shard_stats_ref
from verl.ops.logprob import _shard_backward_ref, linear_logprob_entropy_ref
from verl.ops.losses import (KL_KINDS, Aggregation, _agg, agg_loss, agg_loss_ref, kl_loss,
                             kl_loss_ref, policy_loss,
                             policy_loss_ref)

__all__ = ["HEAD_LOSSES", "HeadLossOutput", "check_linear_rl_loss", "linear_rl_loss", "linear_rl_loss_ref",
           "vocab_parallel_linear_rl_loss"]

HEAD_LOSSES = ("vanilla", "gspo", "reinforce")
STAT_NAMES = ("pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy_mean",
              "kl_mean")


class HeadLossOutput(NamedTuple):
    """loss: 0-d (float32; float64 for float64 inputs), differentiable in hidden and weight. The rest detached:
    pg_loss / kl_loss / entropy_loss the aggregated parts (loss = pg - entropy_coeff * entropy_loss + kl_coef *
    kl_loss); pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy_mean, kl_mean (mean of logprob - ref) token means
    over the valid tokens, float32; log_probs / entropy [B, T] per token (0 where the mask is 0)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    entropy_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    entropy_mean: torch.Tensor
    kl_mean: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor


# ---------------------------------------------------------------------------------------------- checks

def _bt_input(t: torch.Tensor | None, mask: torch.Tensor, op: str, name: str) -> None:
    if t is None:
        return
    check_floating(t, op, name)
    check_same_device(mask, t, op, "mask", name)
    check_same_shape(mask, t, op, "mask", name)


def check_linear_rl_loss(hidden, weight, labels, mask, advantages, old_logprob, ref_logprob, temperature, loss_type,
                         clip_low, clip_high, clip_c, kl_kind, kl_coef, entropy_coeff, chunk_n,
                         op: str = "linear_rl_loss", vocab_size: int | None = None) -> float:
    """What the linear_rl_loss kernel checks (csrc/include/verl/rl_head.h), run on both backends; hidden [B*T, H].
    vocab_size: the whole vocabulary when `weight` is a shard. Returns the temperature as a float."""
    check_name(loss_type, HEAD_LOSSES, "fused loss head policy loss")
    check_name(kl_kind, KL_KINDS, "KL kind")
    check_arg(int(chunk_n) >= 0, op, f"`chunk_n` must be >= 0 (0 = the backend's default chunk), got {chunk_n}")
    t = _check_temperature(temperature, op)
    check_arg(abs(float(kl_coef)) < float("inf"), op, f"`kl_coef` must be finite, got {kl_coef}")
    check_arg(abs(float(entropy_coeff)) < float("inf"), op, f"`entropy_coeff` must be finite, got {entropy_coeff}")
    _check_linear(hidden, weight, op)
    check_arg(hidden.dim() == 2, op, f"`hidden` must be 2-D [B*T, H] here, got shape {list(hidden.shape)}")
    check_arg(mask.dim() == 2, op, f"`mask` must be 2-D [B, T] (sequences x response tokens), got shape "
                                   f"{list(mask.shape)}")
    check_same_device(hidden, mask, op, "hidden", "mask")
    if mask.is_complex():
        raise TypeError(f"{op}: `mask` must be bool or a real dtype (nonzero = valid), got {mask.dtype}")
    check_arg(hidden.shape[0] == mask.numel(), op, f"`hidden` has N={hidden.shape[0]} rows but `mask` is [B, T] = "
                                                   f"{list(mask.shape)}; pass hidden as [B * T, H] (one row per "
                                                   f"response token, row-major)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: `labels` must be int64 or int32, got {labels.dtype}")
    check_same_device(hidden, labels, op, "hidden", "labels")
    check_same_shape(mask, labels, op, "mask", "labels")
    check_arg(advantages is not None, op, "`advantages` [B, T] is required")
    for name, x in (("advantages", advantages), ("old_logprob", old_logprob), ("ref_logprob", ref_logprob)):
        _bt_input(x, mask, op, name)
    clip_high = clip_low if clip_high is None else clip_high
    check_arg(0.0 <= clip_low < 1.0, op, f"`clip_low` must be in [0, 1) (ratio lower bound 1 - clip_low), "
                                         f"got {clip_low}")
    check_arg(clip_high >= 0.0, op, f"`clip_high` must be >= 0, got {clip_high}")
    check_arg(clip_c > 1.0, op, f"`clip_c` (dual-clip constant) must be > 1, got {clip_c}; pass inf to turn dual "
                                f"clip off")
    if not torch.compiler.is_compiling() and labels.numel():
        vocab = weight.shape[0] if vocab_size is None else vocab_size
        bad = (mask != 0) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{op}: `labels`[{b}, {i}] = {int(labels[b, i])} is a valid (mask != 0) token outside "
                             f"the vocabulary [0, {vocab})")
    return t


# ---------------------------------------------------------------------------------------------- reference

def _parts(lp, ent, mask, advantages, old_logprob, ref_logprob, loss_type, clip_low, clip_high, clip_c, kl_kind,
           kl_coef, entropy_coeff, agg, ref_ops: bool):
    """The actor loss of verl.algos.actor_loss on per-token (lp, ent) [B, T]: (loss, stats [8] float32)."""
    pl, kll, al = (policy_loss_ref, kl_loss_ref, agg_loss_ref) if ref_ops else (policy_loss, kl_loss, agg_loss)
    old = lp.detach() if old_logprob is None else old_logprob
    kw = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, agg=agg)
    pg = pl(lp, old, advantages, mask, loss_type, **kw)
    ent_loss = al(ent, mask, agg)
    loss = pg.loss - entropy_coeff * ent_loss
    valid = mask != 0
    count = valid.sum().clamp(min=1)
    zero = lp.new_zeros(())
    kl_part, kl_mean = zero, zero
    if ref_logprob is not None:
        kl_mean = torch.where(valid, (lp - ref_logprob).detach(), 0.0).sum() / count
        if kl_coef:
            kl_part = kll(lp, ref_logprob, mask, kl_kind, agg)
            loss = loss + kl_coef * kl_part
    ent_mean = torch.where(valid, ent.detach(), 0.0).sum() / count
    stats = torch.stack([pg.loss.detach().float(), kl_part.detach().float(), ent_loss.detach().float(),
                         pg.pg_clipfrac.float(), pg.pg_clipfrac_lower.float(), pg.ppo_kl.float(), ent_mean.float(),
                         kl_mean.float()])
    return loss, stats


def _output(loss, stats, lp, ent) -> HeadLossOutput:
    return HeadLossOutput(loss, *stats.unbind(0), lp.detach(), ent.detach())


def linear_rl_loss_ref(hidden, weight, labels, mask, advantages, *, old_logprob=None, ref_logprob=None,
                       temperature: float = 1.0, loss_type: str = "vanilla", clip_low: float = 0.2,
                       clip_high: float | None = None, clip_c: float = 3.0, kl_kind: str = "low_var_kl",
                       kl_coef: float = 0.0, entropy_coeff: float = 0.0, agg: Aggregation | str | None = None,
                       chunk_n: int = 0) -> HeadLossOutput:
    """Pure-PyTorch reference: the whole [N, V] logits, log_softmax (linear_logprob_entropy_ref), then the
    reference policy / KL / entropy losses; differentiable by autograd. hidden [B, T, H] or [B*T, H]."""
    h = hidden.reshape(-1, hidden.shape[-1])
    ch = clip_low if clip_high is None else clip_high
    check_linear_rl_loss(h, weight, labels, mask, advantages, old_logprob, ref_logprob, temperature, loss_type,
                         clip_low, ch, clip_c, kl_kind, kl_coef, entropy_coeff, chunk_n)
    valid = mask != 0
    y = torch.where(valid, labels, -100).reshape(-1)
    lp, ent = linear_logprob_entropy_ref(h, weight, y, temperature)
    lp, ent = lp.view(mask.shape), ent.view(mask.shape)
    loss, stats = _parts(lp, ent, mask, advantages, old_logprob, ref_logprob, loss_type, clip_low, ch, clip_c,
                         kl_kind, kl_coef, entropy_coeff, _agg(agg), ref_ops=True)
    return _output(loss, stats, lp, ent)


# ---------------------------------------------------------------------------------------------- public wrapper

def linear_rl_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                   advantages: torch.Tensor, *, old_logprob: torch.Tensor | None = None,
                   ref_logprob: torch.Tensor | None = None, temperature: float = 1.0, loss_type: str = "vanilla",
                   clip_low: float = 0.2, clip_high: float | None = None, clip_c: float = 3.0,
                   kl_kind: str = "low_var_kl", kl_coef: float = 0.0, entropy_coeff: float = 0.0,
                   agg: Aggregation | str | None = None, chunk_n: int = 0) -> HeadLossOutput:
    """The actor's loss from hidden [B, T, H] (or [B*T, H]) and the LM head weight [V, H] (same dtype); labels,
    mask, advantages, old_logprob, ref_logprob [B, T]. See the module docstring. chunk_n: valid tokens per chunk
    (0: the backend's default, 24 MiB of float32 logits and >= 192 rows on CPU, 2^28 logits and >= 1024 rows on
    CUDA).
    Gradients flow to hidden and weight only."""
    op = "linear_rl_loss"
    h = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() >= 1 else hidden
    ch = clip_low if clip_high is None else clip_high
    t = check_linear_rl_loss(h, weight, labels, mask, advantages, old_logprob, ref_logprob, temperature, loss_type,
                             clip_low, ch, clip_c, kl_kind, kl_coef, entropy_coeff, chunk_n)
    a = _agg(agg, mask, op)
    if not use_fused(op, h, weight):
        return linear_rl_loss_ref(h, weight, labels, mask, advantages, old_logprob=old_logprob,
                                  ref_logprob=ref_logprob, temperature=t, loss_type=loss_type, clip_low=clip_low,
                                  clip_high=ch, clip_c=clip_c, kl_kind=kl_kind, kl_coef=kl_coef,
                                  entropy_coeff=entropy_coeff, agg=a, chunk_n=chunk_n)
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    det = (lambda x: None if x is None else x.detach())  # noqa: E731
    loss, stats, lp, ent, _, _ = torch.ops.verl.linear_rl_loss(
        h, weight, labels, mask, advantages.detach(), det(old_logprob), det(ref_logprob), t, loss_type,
        float(clip_low), float(ch), float(clip_c), kl_kind, float(kl_coef), float(entropy_coeff), *a.args(),
        int(chunk_n), with_grad, weight.requires_grad)  # a frozen head (LoRA): GEMM 3 skipped
    return _output(loss, stats, lp, ent)


# ---------------------------------------------------------------------------------------------- vocab parallel

def _global_agg(a: Aggregation, mask: torch.Tensor) -> Aggregation:
    """The aggregation with this batch's counts filled in, so a loss over any subset of its sequences is exactly
    that subset's share of the whole (row weights depend on the counts and the row alone)."""
    valid = mask != 0
    tokens = float(valid.sum()) if a.global_tokens is None else a.global_tokens
    seqs = float((valid.sum(-1) > 0).sum()) if a.global_seqs is None else a.global_seqs
    norm_len = float(mask.shape[-1]) if a.norm_len is None else a.norm_len
    return Aggregation(mode=a.mode, global_tokens=tokens, global_seqs=seqs, dp_size=a.dp_size, norm_len=norm_len)


def _token_grads(lp, ent, rows, mask, adv, old, ref, kw):
    """(loss, stats sums [8] float64, d loss / d lp, d loss / d ent) of a chunk of whole sequences [b, T]."""
    # in float64, as the kernel's per-token terms (csrc/include/verl/rl_head.h)
    lp = lp.detach().double().requires_grad_()
    ent = ent.detach().double().requires_grad_()
    pick = (lambda x: None if x is None else x[rows].double())  # noqa: E731
    m = mask[rows]
    with torch.enable_grad():  # autograd.Function.forward runs without it
        loss, stats = _parts(lp, ent, m, pick(adv), pick(old), pick(ref), **kw, ref_ops=False)
        glp, gh = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    n = float((m != 0).sum())
    sums = stats.double() * torch.tensor([1.0] * 3 + [n] * 5, dtype=torch.float64, device=stats.device)
    return loss.detach().double(), sums, glp, (torch.zeros_like(ent) if gh is None else gh)


class _VocabParallelRlLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, mask, adv, old, ref, t, group, kw, seqs_per_chunk, layout):
        start, vocab, reduce_grad_hidden = layout
        B, T = mask.shape
        fused = use_fused("logprob_entropy_shard", hidden, weight)
        dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lp_all, ent_all = (torch.zeros(B, T, dtype=dt, device=hidden.device) for _ in range(2))
        loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
        sums = torch.zeros(8, dtype=torch.float64, device=hidden.device)
        gh_all, gw = torch.zeros_like(hidden), torch.zeros_like(weight)
        for b0 in range(0, B, seqs_per_chunk):
            rows = slice(b0, min(B, b0 + seqs_per_chunk))
            flat = (mask[rows] != 0).reshape(-1).nonzero().view(-1) + b0 * T  # valid token rows of hidden
            y = labels.reshape(-1)[flat].long()
            h_c = hidden[flat]
            logits = h_c @ weight.t()  # GEMM 1
            stats_fn = torch.ops.verl.logprob_entropy_shard if fused else None
            st = (stats_fn(logits, y, t, start, vocab, -100) if fused
                  else _shard_stats_ref(logits, y, t, start, -100))
            lp, ent, lse = _combine(*st, torch.ones_like(y, dtype=torch.bool), group)
            lp_bt, ent_bt = torch.zeros_like(lp_all[rows]), torch.zeros_like(ent_all[rows])
            local = flat - b0 * T
            lp_bt.view(-1)[local], ent_bt.view(-1)[local] = lp.to(dt), ent.to(dt)
            lp_all[rows], ent_all[rows] = lp_bt, ent_bt
            l_c, s_c, glp, gent = _token_grads(lp_bt, ent_bt, rows, mask, adv, old, ref, kw)
            loss += l_c
            sums += s_c
            glp, gent = glp.reshape(-1)[local].to(lse.dtype), gent.reshape(-1)[local].to(lse.dtype)
            g = (torch.ops.verl.logprob_entropy_backward(glp, gent, None, logits, y, lse, ent, t, start, -100)
                 if fused else _shard_backward_ref(glp, gent, logits, y, lse, ent, t, start, -100))
            gh_all[flat] = (g @ weight).to(hidden.dtype)  # GEMM 2
            gw += (g.t() @ h_c).to(weight.dtype)  # GEMM 3
        if reduce_grad_hidden:
            dist.all_reduce(gh_all, op=dist.ReduceOp.SUM, group=group)
        n = float((mask != 0).sum())
        stats = torch.cat([sums[:3], sums[3:] / max(n, 1.0)]).float()
        ctx.save_for_backward(gh_all, gw)
        ctx.mark_non_differentiable(stats, lp_all, ent_all)
        ctx.set_materialize_grads(False)
        return loss.to(dt), stats, lp_all, ent_all

    @staticmethod
    def backward(ctx, grad, *_unused):
        gh, gw = ctx.saved_tensors
        return (_scale_in_place(grad, gh), _scale_in_place(grad, gw)) + (None,) * 10


def vocab_parallel_linear_rl_loss(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                  mask: torch.Tensor, advantages: torch.Tensor, group: dist.ProcessGroup | None, *,
                                  old_logprob: torch.Tensor | None = None, ref_logprob: torch.Tensor | None = None,
                                  temperature: float = 1.0, loss_type: str = "vanilla", clip_low: float = 0.2,
                                  clip_high: float | None = None, clip_c: float = 3.0, kl_kind: str = "low_var_kl",
                                  kl_coef: float = 0.0, entropy_coeff: float = 0.0,
                                  agg: Aggregation | str | None = None, chunk_n: int = 0,
                                  vocab_start: int | None = None, vocab_size: int | None = None,
                                  reduce_grad_hidden: bool = True) -> HeadLossOutput:
    """`linear_rl_loss` with the LM head split by vocabulary over `group` (Megatron's layout: rank r holds rows
    [r * V/tp, (r + 1) * V/tp)). hidden [B, T, H] or [B*T, H], the same on every rank; labels are global ids.
    Returns the same loss and statistics on every rank. chunk_n: tokens per chunk, rounded to whole sequences.
    vocab_start / vocab_size: this shard's first row and the whole vocabulary, when the shard is not the plain
    split (Megatron's padded vocabulary: pass only the real rows). grad_hidden is summed over `group` unless
    reduce_grad_hidden=False (the caller's region already sums it, as Megatron's output layer input does)."""
    op = "vocab_parallel_linear_rl_loss"
    h = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() >= 1 else hidden
    ch = clip_low if clip_high is None else clip_high
    start, vocab = _group_layout(group, weight_shard.shape[0])
    start = start if vocab_start is None else int(vocab_start)
    vocab = vocab if vocab_size is None else int(vocab_size)
    t = check_linear_rl_loss(h, weight_shard, labels, mask, advantages, old_logprob, ref_logprob, temperature,
                             loss_type, clip_low, ch, clip_c, kl_kind, kl_coef, entropy_coeff, chunk_n, op=op,
                             vocab_size=vocab)
    T = max(mask.shape[1], 1)
    seqs = max(1, (int(chunk_n) or max(256, (1 << 24) // weight_shard.shape[0])) // T)
    kw = dict(loss_type=loss_type, clip_low=clip_low, clip_high=ch, clip_c=clip_c, kl_kind=kl_kind, kl_coef=kl_coef,
              entropy_coeff=entropy_coeff, agg=_global_agg(_agg(agg), mask))
    det = (lambda x: None if x is None else x.detach())  # noqa: E731
    layout = (start, vocab, reduce_grad_hidden)
    loss, stats, lp, ent = _VocabParallelRlLoss.apply(h, weight_shard, labels, mask, advantages.detach(),
                                                      det(old_logprob), det(ref_logprob), t, group, kw, seqs, layout)
    return _output(loss, stats, lp, ent)


# ------------------------------------------------------------------------- fake implementation + autograd

def _fake_linear_rl_loss(hidden, weight, labels, mask, advantages, old_logprob, ref_logprob, temperature, loss_type,
                         clip_low, clip_high, clip_c, kl_kind, kl_coef, entropy_coeff, mode, global_tokens,
                         global_seqs, dp_size, norm_len, chunk_n, with_grad, grad_weight=True):
    torch._check(hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1],
                 lambda: f"`hidden` [N, H] and `weight` [V, H] disagree: {tuple(hidden.shape)}, {tuple(weight.shape)}")
    torch._check(mask.dim() == 2 and hidden.shape[0] == mask.shape[0] * mask.shape[1],
                 lambda: f"`hidden` must be [B*T, H] for `mask` [B, T], got {tuple(hidden.shape)}")
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    gh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if with_grad else hidden.new_empty((0,))
    gw = (torch.empty_like(weight, memory_format=torch.contiguous_format) if with_grad and grad_weight
          else weight.new_empty((0,)))
    return (hidden.new_empty((), dtype=dt), hidden.new_empty((8,), dtype=torch.float32),
            hidden.new_empty(mask.shape, dtype=dt), hidden.new_empty(mask.shape, dtype=dt), gh, gw)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[4], output[5])
    ctx.mark_non_differentiable(*output[1:])
    # Without this autograd hands backward a zero tensor for every other output: a [V, H] one for grad_weight.
    ctx.set_materialize_grads(False)
    ctx.with_grad, ctx.grad_weight = inputs[21], inputs[22] if len(inputs) > 22 else True


def _backward(ctx, grad, *_unused):
    if not ctx.with_grad:
        raise RuntimeError("verl::linear_rl_loss was called with with_grad=False, so it saved no gradient to "
                           "differentiate; call it with with_grad=True (verl.ops.linear_rl_loss does when autograd "
                           "records)")
    gh, gw = ctx.saved_tensors
    out = [None] * len(ctx.needs_input_grad)
    if ctx.needs_input_grad[0]:
        out[0] = _scale_in_place(grad, gh)
    if ctx.needs_input_grad[1]:
        if not ctx.grad_weight:
            raise RuntimeError("verl::linear_rl_loss was called with grad_weight=False, so it computed no gradient "
                               "for `weight`; call it with grad_weight=True (verl.ops.linear_rl_loss does when the "
                               "weight requires grad)")
        out[1] = _scale_in_place(grad, gw)
    return tuple(out)


def _scale_in_place(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """The saved d loss / d input times grad_output, in the saved tensor's own memory: a scaled copy would hold a
    second [V, H] grad_weight at the peak. The graph's saved gradients are then spent, so backwarding it a second
    time (retain_graph=True) is refused by autograd's in-place check rather than giving wrong numbers. Traced
    (torch.compile / AOT autograd: tensor subclasses) it is the out-of-place op, which the compiler may fuse."""
    if type(saved) is not torch.Tensor:
        return torch.ops.verl.loss_grad_scale(grad, saved)
    return saved.mul_(grad.reshape(()).to(saved.dtype))


if _extension.available() and "linear_rl_loss" in _extension.op_names():
    _extension.register_python_parts({"linear_rl_loss": _fake_linear_rl_loss},
                                     {"linear_rl_loss": (_backward, _setup)})
