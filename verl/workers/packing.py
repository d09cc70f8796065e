"""Padding-free micro-batches: a micro-batch's real tokens concatenated into one row, and the micro-batches
themselves cut by a token budget instead of a sequence count.

Packing (`pack`): the tokens of a `RolloutBatch` micro-batch where `attention_mask` is 1, row after row, become
one sequence [1, T] (T = real tokens, no padding). Each original row keeps its own position ids (the running
count of its real tokens, as `RolloutBatch.position_ids` defines them, restarting at 0), and attention stays
within a row:
  - Hugging Face models get `attention_mask=None` and the restarting `position_ids` (the same RoPE positions
    as the padded batch); `packed_attention` says how their attention stays within a row: flash-attention 2/3
    runs its varlen kernels from the position ids; SDPA and eager attention are replaced, for the packed
    forward, by verl's per-sequence SDPA (verl/workers/varlen_attention.py, fed the row's `cu_seqlens`), so no
    [T, T] mask is built; where that cannot stand in (soft-capped or sink logits, gradient checkpointing,
    composite models) and for flex attention, transformers (`masking_utils.find_packed_sequence_indices`)
    builds a block-diagonal causal mask from the position ids. `pack_shared`'s layout is not one causal block
    per sequence: its own [T, T] mask goes to the model as given.
  - megatron gets a block-diagonal causal `[1, 1, T, T]` mask (`block_causal_mask`) for its local attention
    (megatron-core's `PackedSeqParams` / thd format needs Transformer Engine's attention; the local
    DotProductAttention refuses it).
The outputs that predict response tokens (`src` positions) are gathered and scattered back into the workers'
[b, R] response layout by `PackedBatch.unpack` (0 where the padded layout had padding), so loss functions and
their aggregation see exactly what the padded path gives them.

Token budget (`micro_batch_slices`): consecutive rows fill a micro-batch until the next would take its real
tokens past `max_tokens`; every data-parallel rank then splits its largest micro-batches until all have the
same count (FSDP gathers parameters per micro-batch, collectively).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError
from verl.workers.batch import RolloutBatch, micro_slices
from verl.workers.varlen_attention import VARLEN, varlen_attention, varlen_unsupported

__all__ = ["PackedBatch", "block_causal_mask", "check_varlen_attention", "micro_batch_slices", "pack",
           "pack_shared", "packed_attention", "padded_token_share", "token_budget_slices"]


@dataclass(kw_only=True, slots=True)
class PackedBatch:
    """One micro-batch's real tokens as a single row, and where its outputs go in the [b, R] layout."""

    input_ids: torch.Tensor
    """[1, T] the rows' real tokens, concatenated (plus `pad` tokens of their own sequence at the end)."""
    position_ids: torch.Tensor
    """[1, T] position of each token within its row (restarts at 0 for every row)."""
    seq_ids: torch.Tensor
    """[T] long, the row each token came from (b for the trailing pad tokens)."""
    cu_seqlens: torch.Tensor
    """[b + 1] int32 (one more with pad tokens): cumulative sequence lengths, the varlen-attention layout."""
    max_seqlen: int
    """Longest row, in tokens."""
    src: torch.Tensor
    """[N] long, packed index of each token whose output predicts a response token."""
    rows: torch.Tensor
    """[N] long, the row of that response token."""
    cols: torch.Tensor
    """[N] long, its response column (0..R-1)."""
    targets: torch.Tensor
    """[N] long, the response token it predicts."""
    shape: tuple[int, int]
    """(b, R): the response layout `unpack` fills."""
    attention: torch.Tensor | None = None
    """[1, 1, T, T] bool (True = attends) when the layout is not one causal block per sequence (`pack_shared`:
    responses of one prompt share its tokens); None: the position ids say where sequences start."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[N, ...] per-response-token values → [b, R, ...] (0 elsewhere); differentiable."""
        out = values.new_zeros(tuple(self.shape) + tuple(values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


def pack(mb: RolloutBatch, multiple: int = 1) -> PackedBatch:
    """`mb`'s real tokens as one row (module docstring); the length is padded up to a multiple of `multiple`
    (sequence parallelism splits the sequence over TP ranks) with a separate sequence no row attends to."""
    keep = mb.attention_mask.bool()
    b, S = keep.shape
    P = mb.prompt_length
    lengths = keep.sum(-1)
    running = keep.long().cumsum(-1) - 1
    ids, pos = mb.input_ids[keep], running[keep]
    seq = torch.arange(b, device=keep.device).repeat_interleave(lengths)
    index = (keep.flatten().long().cumsum(0) - 1).view(b, S)
    # response t is predicted by column P - 1 + t; both that column and the response token must be real
    valid = keep[:, P:] & keep[:, P - 1:S - 1]
    rows, cols = valid.nonzero(as_tuple=True)
    pad = -ids.numel() % multiple
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        pos = torch.cat([pos, torch.arange(pad, device=pos.device)])
        seq = torch.cat([seq, seq.new_full((pad,), b)])
        lengths = torch.cat([lengths, lengths.new_tensor([pad])])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=keep.device)
    cu[1:] = lengths.cumsum(0)
    return PackedBatch(input_ids=ids[None], position_ids=pos[None], seq_ids=seq, cu_seqlens=cu,
                       max_seqlen=int(lengths.max()) if len(lengths) else 0, src=index[rows, P - 1 + cols],
                       rows=rows, cols=cols, targets=mb.input_ids[rows, P + cols], shape=(b, S - P))


def pack_shared(mb: RolloutBatch) -> PackedBatch:
    """`pack` with each run of consecutive rows that have the same real prompt tokens (a GRPO group: rollout
    output is prompt-major) sharing one copy of the prompt: [prompt, response 1, response 2, ...], every response
    at the positions it has in its own row, attending to the prompt and to itself (`attention`), so the prompt's
    forward and backward run once per group instead of once per response. Outputs, losses and gradients are the
    padded batch's up to float rounding; the prompt's last output predicts every response's first token."""
    keep = mb.attention_mask.bool()
    b, S = keep.shape
    P = mb.prompt_length
    running = keep.long().cumsum(-1) - 1
    index = torch.zeros(b, S, dtype=torch.long, device=keep.device)
    ids, pos, group, seq = [], [], [], []
    n, prompt, g = 0, None, -1
    for r in range(b):
        row_prompt = mb.input_ids[r, :P][keep[r, :P]]
        if prompt is None or not torch.equal(row_prompt, prompt):
            prompt, g, start = row_prompt, g + 1, n
            ids.append(row_prompt)
            pos.append(running[r, :P][keep[r, :P]])
            group.append(torch.full_like(row_prompt, g))
            seq.append(torch.full_like(row_prompt, -1))  # -1: a prompt token, seen by every response of the group
            n += len(row_prompt)
        index[r, :P][keep[r, :P]] = start + torch.arange(len(row_prompt), device=keep.device)
        real = keep[r, P:]
        m = int(real.sum())
        ids.append(mb.input_ids[r, P:][real])
        pos.append(running[r, P:][real])
        group.append(torch.full((m,), g, dtype=torch.long, device=keep.device))
        seq.append(torch.full((m,), r, dtype=torch.long, device=keep.device))
        index[r, P:][real] = n + torch.arange(m, device=keep.device)
        n += m
    group, seq = torch.cat(group), torch.cat(seq)
    causal = torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()
    attends = causal & (group[:, None] == group[None, :]) & ((seq[None, :] == -1) | (seq[:, None] == seq[None, :]))
    valid = keep[:, P:] & keep[:, P - 1:S - 1]
    rows, cols = valid.nonzero(as_tuple=True)
    cu = torch.tensor([0, n], dtype=torch.int32, device=keep.device)
    return PackedBatch(input_ids=torch.cat(ids)[None], position_ids=torch.cat(pos)[None], seq_ids=seq.clamp(min=0),
                       cu_seqlens=cu, max_seqlen=n, src=index[rows, P - 1 + cols], rows=rows, cols=cols,
                       targets=mb.input_ids[rows, P + cols], shape=(b, S - P), attention=attends[None, None])


def block_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked out (megatron's convention): causal within each sequence, nothing
    across sequences."""
    T = seq_ids.numel()
    causal = torch.ones(T, T, dtype=torch.bool, device=seq_ids.device).tril()
    allowed = causal & (seq_ids[:, None] == seq_ids[None, :])
    return ~allowed[None, None]


def token_budget_slices(lengths: list[int], max_tokens: int) -> list[slice]:
    """Consecutive rows per micro-batch, as many as fit in `max_tokens` real tokens (at least one row each)."""
    slices, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise VerlConfigError(f"a sequence of {n} tokens (prompt + response) exceeds the micro-batch token budget "
                                  f"max_tokens_per_micro_batch={max_tokens}; raise it to at least "
                                  f"data.max_prompt_length + rollout.max_new_tokens, or set it to 0 (count-based)")
        if used + n > max_tokens:
            slices.append(slice(start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        slices.append(slice(start, len(lengths)))
    return slices


def _split_to(slices: list[slice], count: int) -> list[slice]:
    """`slices` with their largest (in rows) halved until there are `count` of them, order kept."""
    slices = list(slices)
    while len(slices) < count:
        i = max(range(len(slices)), key=lambda j: slices[j].stop - slices[j].start)
        sl = slices[i]
        if sl.stop - sl.start < 2:
            raise VerlConfigError(f"another data-parallel rank needs {count} micro-batches for its token budget, and "
                                  f"this rank has only {slices[-1].stop - slices[0].start} rows to fill them; "
                                  f"give every rank the same number of responses, or raise max_tokens_per_micro_batch")
        mid = sl.start + (sl.stop - sl.start) // 2
        slices[i:i + 1] = [slice(sl.start, mid), slice(mid, sl.stop)]
    return slices


def micro_batch_slices(batch: RolloutBatch, micro_batch_size: int, max_tokens: int = 0,
                       group: dist.ProcessGroup | None = None) -> list[slice]:
    """Row ranges of the micro-batches: `micro_batch_size` rows each, or (max_tokens > 0) filled by real tokens
    up to `max_tokens`, with the same number of micro-batches on every rank of `group` (collective then)."""
    if max_tokens <= 0:
        return micro_slices(len(batch), micro_batch_size)
    slices = token_budget_slices(batch.attention_mask.sum(-1).tolist(), max_tokens)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        from verl.distributed.placement import comm_device
        count = torch.tensor([len(slices)], dtype=torch.long, device=comm_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        slices = _split_to(slices, int(count))
    return slices


def padded_token_share(batch: RolloutBatch, slices: list[slice]) -> float:
    """Share of the positions a padded forward over these micro-batches computes that are padding."""
    total = sum((sl.stop - sl.start) * batch.input_ids.shape[1] for sl in slices)
    return 1.0 - batch.num_tokens() / total if total else 0.0


_WARNED: set[str] = set()


_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def check_varlen_attention(module: torch.nn.Module) -> str:
    """The attention a packed forward of this Hugging Face model (or `ValueModel`) runs: flash-attention's
    varlen kernels, `VARLEN` in place of SDPA / eager attention, or else the model's own implementation over
    transformers' block-diagonal [T, T] mask (warned about once per reason and device: it costs T² per layer,
    with T the micro-batch's tokens). Refused when its modeling code does not build masks with transformers'
    masking_utils (the packed rows would attend to each other)."""
    trunk = getattr(module, "trunk", module)
    modeling = sys.modules.get(type(trunk).__module__)
    if not any(hasattr(modeling, name) for name in _MASK_BUILDERS):
        raise VerlConfigError(f"padding_free: {type(trunk).__name__} ({type(trunk).__module__}) does not build its "
                              f"attention mask with transformers' masking_utils, so the responses packed into one "
                              f"row would attend to each other; set actor.padding_free=false and "
                              f"critic.padding_free=false for this model")
    impl = str(getattr(getattr(trunk, "config", None), "_attn_implementation", None) or "sdpa")
    if impl not in ("sdpa", "eager"):
        return impl
    reason = varlen_unsupported(trunk)
    if reason is None:
        return VARLEN
    device = next(module.parameters()).device
    key = f"{impl}:{device}:{reason}"
    if key not in _WARNED:
        _WARNED.add(key)
        fix = ("load the model with attn_implementation='flash_attention_2'"
               if importlib.util.find_spec("flash_attn") is not None
               else "flash-attn is not installed: `pip install flash-attn --no-build-isolation`, then load the model "
                    "with attn_implementation='flash_attention_2'")
        if device.type != "cuda":
            fix = "set actor.padding_free=false and critic.padding_free=false where the mask costs more than padding"
        warnings.warn(f"padding-free training with attn_implementation={impl!r} on {device}: verl's per-sequence "
                      f"attention cannot stand in because {reason}, so each packed micro-batch attends through a "
                      f"block-diagonal [T, T] mask; {fix}", stacklevel=3)
    return impl


@contextmanager
def packed_attention(module: torch.nn.Module, packed: PackedBatch) -> Iterator[dict]:
    """The attention arguments of a packed forward of `module` (a Hugging Face model or `ValueModel`), to be run
    inside the block: `VARLEN` attention from the row's `cu_seqlens` where `check_varlen_attention` chooses it,
    else the position ids alone (flash-attention, or transformers' block mask); `pack_shared`'s mask as given."""
    impl = check_varlen_attention(module)
    if impl != VARLEN or packed.attention is not None:
        yield {"attention_mask": packed.attention}
        return
    # host-side boundaries: the attention slices the row by them in every layer without a device sync
    cu = packed.cu_seqlens.cpu()
    with varlen_attention(getattr(module, "trunk", module)):
        yield {"attention_mask": None, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": packed.max_seqlen,
               "max_length_k": packed.max_seqlen}
