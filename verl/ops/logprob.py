"""Per-token log-probs and entropies over the vocabulary without materialising softmax (or even the logits).

    lp, ent = verl.ops.logprob_entropy(logits, labels, temperature=1.0)              # logits [..., V]
    lp, ent = verl.ops.linear_logprob_entropy(hidden, lm_head.weight, labels)         # hidden [..., H]
    lp, ent = verl.ops.vocab_parallel_logprob_entropy(logits_shard, labels, t, group) # tensor parallel
    lp, ent = verl.ops.vocab_parallel_linear_logprob_entropy(hidden, weight_shard, labels, t, group)

Conventions (kernels and references alike):
- z = logits / temperature; logprob = log softmax(z)[label]; entropy = -sum softmax(z) log softmax(z).
- Rows whose label == ignore_index (default -100) give logprob 0 and entropy 0 and receive no gradient, so
  padding costs nothing and cannot leak into a loss.
- Outputs are float32, or float64 for float64 inputs (16-bit log-probs are too coarse for PPO ratios).
  Gradients come back in the inputs' dtype.
- Labels outside [0, V) other than ignore_index, temperature <= 0, mismatched N and hidden/weight dtype
  mismatches raise errors naming the argument. Inputs need not be contiguous (the kernels read strided rows
  of logits in place and copy anything else once).

The fused ops (csrc/cpu/logprob.cpp, csrc/cuda/logprob.cu, shared drivers in csrc/include/verl/logprob.h):
`logprob_entropy` streams each row once with an online softmax; `linear_logprob_entropy` computes the logits
chunk_n x chunk_v at a time with BLAS / cuBLAS GEMMs and folds each chunk into the same online state, and its
backward recomputes the chunk logits instead of saving them, so extra memory is O(chunk_n * chunk_v) and
independent of V. Rows whose label is ignore_index are left out of the GEMMs altogether (their valid
siblings are gathered once, [N_valid, H]), so padding costs no GEMM time. On CPU the 4 GEMMs of a training
step (forward, then recompute + grad_hidden + grad_weight) run at BLAS speed and the exp/log epilogue is
~2% of the time; eager needs 3 GEMMs but spends about one GEMM's time in memory-bound passes over its
[N, V] tensors. `verl.ops.set_backend("reference")` swaps in the pure-PyTorch references below.

Vocab parallelism follows Megatron's layout: in a group of tp ranks, rank r holds the contiguous vocab slice
[r * V/tp, (r + 1) * V/tp) of the logits or of the LM head weight (as `VocabParallelEmbedding` and the column
parallel output layer shard it). Each rank reduces its slice (the heavy part, in the kernels), then one
max all-reduce and one sum all-reduce of [3, N] float32 combine the slices; the target's logit comes from the
rank that owns it. Outputs are replicated on every rank of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.checks import check_arg, check_floating, check_same_device

__all__ = ["logprob_entropy", "linear_logprob_entropy", "vocab_parallel_logprob_entropy",
           "vocab_parallel_linear_logprob_entropy", "logprob_entropy_ref", "linear_logprob_entropy_ref",
           "DEFAULT_CHUNK_N", "DEFAULT_CHUNK_V", "lm_head_logprob_entropy", "lm_head_is_fused",
           "FUSED_LM_HEAD_MIN_VOCAB"]

# 1024 x 4096 float32 logits = 16 MiB of scratch: large enough for BLAS / cuBLAS to run at full speed,
# small enough to stay far below one [N, V] logits tensor at any realistic vocabulary.
DEFAULT_CHUNK_N = 1024
DEFAULT_CHUNK_V = 4096
# exp(-1e4) is 0 in every dtype, so clamping log-probs there changes no value.
_MIN_LOGP = -1e4


# ------------------------------------------------------------------------------------------------ checks

def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_temperature(temperature: float, op: str) -> float:
    t = float(temperature)
    if not (t > 0.0 and t != float("inf")):
        raise ValueError(f"{op}: `temperature` must be a finite number > 0, got {temperature} (sampling at "
                         f"temperature 0 is greedy; use temperature=1.0 for raw log-probs)")
    return t


def _check_labels(labels: torch.Tensor, rows: torch.Size, rows_name: str, vocab_size: int, ignore_index: int,
                  op: str, like: torch.Tensor | None = None) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: `labels` must be int64 or int32, got {labels.dtype}")
    if tuple(labels.shape) != tuple(rows):
        raise ValueError(f"{op}: `labels` has shape {tuple(labels.shape)} but `{rows_name}` has leading shape "
                         f"{tuple(rows)}; they must match (one label per row)")
    if like is not None:
        check_same_device(like, labels, op, rows_name, "labels")
    if torch.compiler.is_compiling() or labels.numel() == 0:
        return  # data-dependent; the fused kernels check it themselves
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        raise ValueError(f"{op}: `labels`[{i}] = {int(labels.flatten()[i])} is outside the vocabulary "
                         f"[0, {vocab_size}) and is not ignore_index={ignore_index}")


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{op}: `weight` must be 2-D [V, H], got shape {tuple(weight.shape)}")
    check_arg(hidden.dim() >= 1, op, "`hidden` must be [..., H], got a 0-d tensor")
    check_floating(hidden, op, "hidden")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{op}: `weight` has dtype {weight.dtype} but `hidden` has {hidden.dtype}; cast one of "
                        f"them so both match")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: `weight` [V, H] has H={weight.shape[1]} but `hidden` [..., H] has "
                         f"H={hidden.shape[-1]}; pass the LM head weight as [vocab, hidden] (as nn.Linear stores it)")
    check_same_device(hidden, weight, op, "hidden", "weight")
    check_arg(weight.shape[0] > 0, op, "`weight` has an empty vocabulary dimension (V=0)")


def _check_chunks(chunk_n: int, chunk_v: int, op: str) -> None:
    check_arg(chunk_n > 0, op, f"`chunk_n` must be > 0, got {chunk_n}")
    check_arg(chunk_v > 0, op, f"`chunk_v` must be > 0, got {chunk_v}")


def check_logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int,
                          op: str = "logprob_entropy") -> float:
    """What the logprob_entropy kernels check (csrc/include/verl/logprob.h), run on both backends; returns the
    temperature as a float. logits [..., V], labels [...]."""
    t = _check_temperature(temperature, op)
    check_arg(logits.dim() >= 1, op, "`logits` must be [..., V], got a 0-d tensor")
    check_floating(logits, op, "logits")
    check_arg(logits.shape[-1] > 0, op, "`logits` has an empty vocabulary dimension (V=0)")
    _check_labels(labels, logits.shape[:-1], "logits", logits.shape[-1], ignore_index, op, like=logits)
    return t


def check_linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 temperature: float, ignore_index: int, chunk_n: int, chunk_v: int,
                                 op: str = "linear_logprob_entropy") -> float:
    """What the linear_logprob_entropy kernels check, run on both backends; returns the temperature."""
    t = _check_temperature(temperature, op)
    _check_chunks(chunk_n, chunk_v, op)
    _check_linear(hidden, weight, op)
    _check_labels(labels, hidden.shape[:-1], "hidden", weight.shape[0], ignore_index, op, like=hidden)
    return t


# ---------------------------------------------------------------------------------------------- references

def logprob_entropy_ref(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                        ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference: log_softmax, gather and entropy over materialised [..., V] tensors."""
    t = check_logprob_entropy(logits, labels, temperature, ignore_index)
    z = logits.to(_out_dtype(logits.dtype)) / t
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    # Clamping keeps p * log p at 0 (not 0 * -inf = NaN) for masked (-inf) vocabulary entries.
    ent = -(logp.exp() * logp.clamp(min=_MIN_LOGP)).sum(-1)
    zero = lp.new_zeros(())
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def linear_logprob_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               temperature: float = 1.0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference: logits = hidden @ weight.T in full, then `logprob_entropy_ref`."""
    check_linear_logprob_entropy(hidden, weight, labels, temperature, ignore_index, DEFAULT_CHUNK_N, DEFAULT_CHUNK_V)
    return logprob_entropy_ref(hidden @ weight.t(), labels, temperature, ignore_index)


def _shard_stats_ref(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_start: int,
                     ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logit if owned else 0, shard lse, shard entropy) of a [N, V/tp] slice; 0 on ignored rows."""
    z = logits.to(_out_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    d = (z - lse.unsqueeze(-1)).clamp(min=_MIN_LOGP)
    ent = -(torch.exp(d) * d).sum(-1)
    valid = labels != ignore_index
    local = labels.long() - vocab_start
    owns = valid & (local >= 0) & (local < z.shape[-1])
    tgt = z.gather(-1, torch.where(owns, local, 0).unsqueeze(-1)).squeeze(-1)
    zero = lse.new_zeros(())
    return torch.where(owns, tgt, zero), torch.where(valid, lse, zero), torch.where(valid, ent, zero)


def _shard_backward_ref(grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None, logits: torch.Tensor,
                        labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float,
                        vocab_start: int, ignore_index: int) -> torch.Tensor:
    """d loss / d logits of a slice, given the whole vocabulary's lse and entropy (formula in logprob.h)."""
    z = logits.to(_out_dtype(logits.dtype)) / temperature
    glp = grad_logprob if grad_logprob is not None else lse.new_zeros(lse.shape)
    gh = grad_entropy if grad_entropy is not None else lse.new_zeros(lse.shape)
    d = (z - lse.unsqueeze(-1)).clamp(min=_MIN_LOGP)
    g = torch.exp(d) * (-glp.unsqueeze(-1) - gh.unsqueeze(-1) * (d + ent.unsqueeze(-1)))
    valid = labels != ignore_index
    local = labels.long() - vocab_start
    owns = valid & (local >= 0) & (local < z.shape[-1])
    g = g.scatter_add(-1, torch.where(owns, local, 0).unsqueeze(-1),
                      torch.where(owns, glp, glp.new_zeros(())).unsqueeze(-1).to(g.dtype))
    g = torch.where(valid.unsqueeze(-1), g / temperature, g.new_zeros(()))
    return g.to(logits.dtype)


# ---------------------------------------------------------------------------------------- public wrappers

def logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each row of softmax(logits / temperature).

    logits [..., V] float; labels [...] int. Returns (logprob [...], entropy [...]) in float32 (float64 for
    float64 logits); 0 and no gradient where labels == ignore_index. Differentiable w.r.t. logits.
    """
    t = check_logprob_entropy(logits, labels, temperature, ignore_index)
    x, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if use_fused("logprob_entropy", x):
        lp, ent, _ = torch.ops.verl.logprob_entropy(x, y, t, ignore_index)
    else:
        lp, ent = logprob_entropy_ref(x, y, t, ignore_index)
    return lp.view(labels.shape), ent.view(labels.shape)


def linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                           ignore_index: int = -100, chunk_n: int = DEFAULT_CHUNK_N,
                           chunk_v: int = DEFAULT_CHUNK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprob_entropy(hidden @ weight.T, labels, temperature)` without ever holding the [N, V] logits.

    hidden [..., H]; weight [V, H] (the LM head, same dtype); labels [...]. chunk_n x chunk_v logits are
    live at a time (forward and backward). Differentiable w.r.t. hidden and weight.
    """
    op = "linear_logprob_entropy"
    t = check_linear_logprob_entropy(hidden, weight, labels, temperature, ignore_index, chunk_n, chunk_v)
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if use_fused(op, h, weight):
        lp, ent, _ = torch.ops.verl.linear_logprob_entropy(h, weight, y, t, ignore_index, chunk_n, chunk_v)
    else:
        lp, ent = linear_logprob_entropy_ref(h, weight, y, t, ignore_index)
    return lp.view(labels.shape), ent.view(labels.shape)


# ----------------------------------------------------------------------------------------- vocab parallel

def _whole_vocabulary(group) -> bool:
    """This rank holds the whole vocabulary: torch.distributed is not initialised (one process), or `group` has
    one rank (TP = 1); the vocab-parallel functions are then the plain ones, with no collective."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


def _group_layout(group, vocab_shard: int) -> tuple[int, int]:
    """(vocab_start, vocab_size) of this rank's slice: Megatron's contiguous split, rank r owns [r*Vs, (r+1)*Vs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab-parallel log-probs need torch.distributed to be initialised "
                           "(torch.distributed.init_process_group) and a `group` over the tensor-parallel ranks")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank * vocab_shard, world * vocab_shard


def _combine(tgt: torch.Tensor, lse_r: torch.Tensor, ent_r: torch.Tensor, valid: torch.Tensor, group):
    """Whole-vocabulary (logprob, entropy, lse) from every rank's slice statistics: two all-reduces.

    lse = M + log s with M = max_r lse_r, s = sum_r a_r, a_r = exp(lse_r - M); and because
    H = sum_r w_r (lse - lse_r + H_r) with w_r = a_r / s,  H = log s + sum_r a_r (H_r - (lse_r - M)) / s.
    """
    m = lse_r.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    a = torch.exp(lse_r - m)
    packed = torch.stack([a, a * (ent_r - (lse_r - m)), tgt])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    log_s = packed[0].log()
    zero = lse_r.new_zeros(())
    lse = torch.where(valid, m + log_s, zero)
    ent = torch.where(valid, log_s + packed[1] / packed[0], zero)
    lp = torch.where(valid, packed[2] - lse, zero)
    return lp, ent, lse


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, group, ignore_index):
        start, vocab = _group_layout(group, logits.shape[-1])
        if use_fused("logprob_entropy_shard", logits):
            stats = torch.ops.verl.logprob_entropy_shard(logits, labels, temperature, start, vocab, ignore_index)
        else:
            _check_labels(labels, logits.shape[:-1], "logits_shard", vocab, ignore_index,
                          "vocab_parallel_logprob_entropy")
            stats = _shard_stats_ref(logits, labels, temperature, start, ignore_index)
        lp, ent, lse = _combine(*stats, labels != ignore_index, group)
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.args = (temperature, start, ignore_index)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, labels, lse, ent = ctx.saved_tensors
        temperature, start, ignore_index = ctx.args
        # Every rank holds the same outputs and the same upstream grads, so each slice's gradient is local.
        if use_fused("logprob_entropy_backward", logits):
            grad = torch.ops.verl.logprob_entropy_backward(grad_logprob, grad_entropy, None, logits, labels, lse, ent,
                                                           temperature, start, ignore_index)
        else:
            grad = _shard_backward_ref(grad_logprob, grad_entropy, logits, labels, lse, ent, temperature, start,
                                       ignore_index)
        return grad, None, None, None, None


class _VocabParallelLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, group, ignore_index, chunk_n, chunk_v, reduce_grad_hidden):
        start, vocab = _group_layout(group, weight.shape[0])
        if use_fused("linear_logprob_entropy_shard", hidden, weight):
            stats = torch.ops.verl.linear_logprob_entropy_shard(hidden, weight, labels, temperature, start, vocab,
                                                                ignore_index, chunk_n, chunk_v)
        else:
            _check_labels(labels, hidden.shape[:-1], "hidden", vocab, ignore_index,
                          "vocab_parallel_linear_logprob_entropy")
            stats = _shard_stats_ref(hidden @ weight.t(), labels, temperature, start, ignore_index)
        lp, ent, lse = _combine(*stats, labels != ignore_index, group)
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.args = (temperature, group, start, ignore_index, chunk_n, chunk_v, reduce_grad_hidden)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        temperature, group, start, ignore_index, chunk_n, chunk_v, reduce_grad_hidden = ctx.args
        if use_fused("linear_logprob_entropy_backward", hidden, weight):
            gh, gw = torch.ops.verl.linear_logprob_entropy_backward(grad_logprob, grad_entropy, None, hidden, weight,
                                                                    labels, lse, ent, temperature, start,
                                                                    ignore_index, chunk_n, chunk_v)
        else:
            g = _shard_backward_ref(grad_logprob, grad_entropy, hidden @ weight.t(), labels, lse, ent, temperature,
                                    start, ignore_index)
            gh, gw = g @ weight, g.t() @ hidden
        if reduce_grad_hidden:
            # hidden is replicated across the group but each rank only saw its slice of the vocabulary: the
            # full gradient is the sum (the all-reduce Megatron's column-parallel output layer does backward).
            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
        return gh, gw, None, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, temperature: float,
                                   group: dist.ProcessGroup | None, ignore_index: int = -100
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprob_entropy` over logits split by vocabulary across the ranks of `group` (tensor parallel).

    logits_shard [..., V/tp]: this rank's contiguous slice [rank * V/tp, (rank + 1) * V/tp) of the vocabulary,
    rank = `dist.get_rank(group)` (Megatron's layout; pad V to a multiple of tp). labels [...] hold global
    token ids, identical on every rank. group: the tensor-parallel process group (None = the default group;
    one process, or a group of one rank, holds the whole vocabulary: this is then `logprob_entropy`).
    Returns (logprob [...], entropy [...]) for the whole vocabulary, equal on every rank. Backward: each rank
    gets d loss / d logits_shard for its slice, with no communication (all ranks hold the same loss).
    """
    op = "vocab_parallel_logprob_entropy"
    t = _check_temperature(temperature, op)
    if logits_shard.dim() < 1 or tuple(labels.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"{op}: `labels` has shape {tuple(labels.shape)} but `logits_shard` has leading shape "
                         f"{tuple(logits_shard.shape[:-1])}; they must match (one label per row)")
    if _whole_vocabulary(group):
        return logprob_entropy(logits_shard, labels, t, ignore_index)
    x, y = logits_shard.reshape(-1, logits_shard.shape[-1]), labels.reshape(-1)
    lp, ent = _VocabParallelLogprobEntropy.apply(x, y, t, group, ignore_index)
    return lp.view(labels.shape), ent.view(labels.shape)


def vocab_parallel_linear_logprob_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                          temperature: float, group: dist.ProcessGroup | None,
                                          ignore_index: int = -100, chunk_n: int = DEFAULT_CHUNK_N,
                                          chunk_v: int = DEFAULT_CHUNK_V, reduce_grad_hidden: bool = True
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_logprob_entropy` with the LM head split by vocabulary across `group` (tensor parallel).

    hidden [..., H], the same on every rank of `group` (all-gather sequence-parallel activations first);
    weight_shard [V/tp, H]: rows [rank * V/tp, (rank + 1) * V/tp) of the LM head (Megatron's column-parallel
    output layer); labels [...] global token ids. Returns whole-vocabulary (logprob, entropy), equal on every
    rank; logits are never held beyond one chunk_n x chunk_v block. Backward: grad_weight_shard is local;
    grad_hidden is all-reduced over `group` unless reduce_grad_hidden=False (set it when the caller's own
    region, e.g. a sequence-parallel gather whose backward is a reduce-scatter, already sums over the group).
    """
    op = "vocab_parallel_linear_logprob_entropy"
    t = _check_temperature(temperature, op)
    _check_linear(hidden, weight_shard, op)
    _check_chunks(chunk_n, chunk_v, op)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{op}: `labels` has shape {tuple(labels.shape)} but `hidden` has leading shape "
                         f"{tuple(hidden.shape[:-1])}; they must match (one label per row)")
    if _whole_vocabulary(group):
        return linear_logprob_entropy(hidden, weight_shard, labels, t, ignore_index, chunk_n, chunk_v)
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    lp, ent = _VocabParallelLinearLogprobEntropy.apply(h, weight_shard, y, t, group, ignore_index, chunk_n, chunk_v,
                                                       reduce_grad_hidden)
    return lp.view(labels.shape), ent.view(labels.shape)


# ------------------------------------------------------------------------- fake implementations + autograd

def _fake_rows(x: torch.Tensor, labels: torch.Tensor, rows_name: str, expect_dim: int = 2):
    torch._check(x.dim() == expect_dim, lambda: f"`{rows_name}` must be 2-D, got shape {tuple(x.shape)}")
    torch._check(x.is_floating_point(), lambda: f"`{rows_name}` must be floating point, got {x.dtype}")
    torch._check(labels.dim() == 1 and labels.shape[0] == x.shape[0],
                 lambda: f"`labels` {tuple(labels.shape)} must be [N] with N = {rows_name}.shape[0] = {x.shape[0]}")
    n = x.shape[0]
    dt = _out_dtype(x.dtype)
    return tuple(x.new_empty((n,), dtype=dt) for _ in range(3))


def _fake_linear(hidden, weight, labels):
    torch._check(weight.dim() == 2, lambda: f"`weight` must be 2-D [V, H], got shape {tuple(weight.shape)}")
    torch._check(hidden.dtype == weight.dtype,
                 lambda: f"`weight` has dtype {weight.dtype} but `hidden` has {hidden.dtype}")
    torch._check(hidden.dim() == 2 and hidden.shape[1] == weight.shape[1],
                 lambda: f"`hidden` [N, H] and `weight` [V, H] disagree on H: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    return _fake_rows(hidden, labels, "hidden")


def _fake_logprob_entropy(logits, labels, temperature=1.0, ignore_index=-100):
    return _fake_rows(logits, labels, "logits")


def _fake_logprob_entropy_shard(logits, labels, temperature, vocab_start, vocab_size, ignore_index=-100):
    return _fake_rows(logits, labels, "logits")


def _fake_logprob_entropy_backward(grad_logprob, grad_entropy, grad_lse, logits, labels, lse, entropy, temperature,
                                   vocab_start=0, ignore_index=-100):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _fake_linear_logprob_entropy(hidden, weight, labels, temperature=1.0, ignore_index=-100,
                                 chunk_n=DEFAULT_CHUNK_N, chunk_v=DEFAULT_CHUNK_V):
    return _fake_linear(hidden, weight, labels)


def _fake_linear_logprob_entropy_shard(hidden, weight, labels, temperature, vocab_start, vocab_size,
                                       ignore_index=-100, chunk_n=DEFAULT_CHUNK_N, chunk_v=DEFAULT_CHUNK_V):
    return _fake_linear(hidden, weight, labels)


def _fake_linear_logprob_entropy_backward(grad_logprob, grad_entropy, grad_lse, hidden, weight, labels, lse, entropy,
                                          temperature, vocab_start=0, ignore_index=-100, chunk_n=DEFAULT_CHUNK_N,
                                          chunk_v=DEFAULT_CHUNK_V):
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output):
    logits, labels, temperature, ignore_index = inputs
    _, ent, lse = output
    ctx.save_for_backward(logits, labels, lse, ent)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index


def _backward(ctx, grad_logprob, grad_entropy, grad_lse):
    logits, labels, lse, ent = ctx.saved_tensors
    grad = torch.ops.verl.logprob_entropy_backward(grad_logprob, grad_entropy, grad_lse, logits, labels, lse, ent,
                                                   ctx.temperature, 0, ctx.ignore_index)
    return grad, None, None, None


def _setup_linear(ctx, inputs, output):
    hidden, weight, labels, temperature, ignore_index, chunk_n, chunk_v = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, labels, lse, ent)
    ctx.args = (temperature, ignore_index, chunk_n, chunk_v)


def _backward_linear(ctx, grad_logprob, grad_entropy, grad_lse):
    hidden, weight, labels, lse, ent = ctx.saved_tensors
    temperature, ignore_index, chunk_n, chunk_v = ctx.args
    gh, gw = torch.ops.verl.linear_logprob_entropy_backward(grad_logprob, grad_entropy, grad_lse, hidden, weight,
                                                            labels, lse, ent, temperature, 0, ignore_index, chunk_n,
                                                            chunk_v)
    return gh, gw, None, None, None, None, None


_FAKES = {"logprob_entropy": _fake_logprob_entropy, "logprob_entropy_shard": _fake_logprob_entropy_shard,
          "logprob_entropy_backward": _fake_logprob_entropy_backward,
          "linear_logprob_entropy": _fake_linear_logprob_entropy,
          "linear_logprob_entropy_shard": _fake_linear_logprob_entropy_shard,
          "linear_logprob_entropy_backward": _fake_linear_logprob_entropy_backward}
# op -> (backward, setup_context); each backward is itself an op. The *_shard ops are differentiated by the
# vocab-parallel autograd functions above, which call the backward ops directly.
_AUTOGRAD = {"logprob_entropy": (_backward, _setup), "linear_logprob_entropy": (_backward_linear, _setup_linear)}


if _extension.available():
    _extension.register_python_parts(_FAKES, _AUTOGRAD)


# ---- the LM head: one function the training engines and the torch engine's exact decoder share, so both
# compute the same numbers bit for bit

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
