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
    builds a block-diagonal causal mask from the position ids. `pack_tree`'s layout (a prefix tree: rows
    share the tokens of their common prefixes) is not one causal block per sequence: `VARLEN` runs it segment by
    segment (each against its context), other attention takes its dense [T, T] mask.
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

__all__ = ["PackedBatch", "TreeCounts", "TreeSegment", "block_causal_mask", "check_varlen_attention",
           "common_prefix", "micro_batch_slices", "pack", "pack_tree", "packed_attention", "padded_token_share",
           "token_budget_slices", "tree_metrics", "tree_tokens"]


@dataclass(frozen=True, slots=True)
class TreeSegment:
    """One run of tokens of a prefix tree (`pack_tree`): packed positions [start, end), which attend causally to
    each other and to every token of `context` (the packed positions of the prefix they continue, in order)."""

    start: int
    end: int
    context: torch.Tensor
    """[A] long: the tokens before this segment on its path from the root (empty for a root segment)."""


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
    tree: tuple[TreeSegment, ...] | None = None
    """`pack_tree`'s layout (rows share the tokens of their common prefixes): the segments, in packed order, and
    what each attends to; None: one causal block per sequence, where the position ids say sequences start."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def attention(self) -> torch.Tensor | None:
        """[1, 1, T, T] bool (True = attends) of a `tree` layout, for attention that takes a dense mask; None
        without a tree."""
        if self.tree is None:
            return None
        T = self.num_tokens
        allowed = torch.zeros(T, T, dtype=torch.bool, device=self.input_ids.device)
        for seg in self.tree:
            allowed[seg.start:seg.end, seg.context] = True
            n = seg.end - seg.start
            allowed[seg.start:seg.end, seg.start:seg.end] = torch.ones(n, n, dtype=torch.bool,
                                                                       device=allowed.device).tril()
        return allowed[None, None]

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


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens the 1-D token tensors `a` and `b` share."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if len(differ) else m


def _real_tokens(mb: RolloutBatch) -> list[torch.Tensor]:
    keep = mb.attention_mask.bool()
    return [mb.input_ids[r][keep[r]] for r in range(len(mb))]


def pack_tree(mb: RolloutBatch, multiple: int = 1) -> PackedBatch:
    """`pack` with the rows' shared prefixes computed once: each row's real tokens (prompt and response as one
    sequence) are laid out as a prefix tree, a row sharing its first k tokens with an earlier row reusing that
    row's packed tokens for them and adding only the rest (a `TreeSegment` that attends to the shared k). A GRPO
    group's prompt is computed once for its rollout.n responses, the chat template's common opening once for the
    micro-batch, the earlier turns of multi-turn rows that continue one another once. Every token keeps the
    position it has in its own row, so its output is the padded batch's up to float rounding; a shared token's
    output predicts the next token of every row through it. `multiple`: as in `pack` (a padding segment)."""
    keep = mb.attention_mask.bool()
    b, S = keep.shape
    P = mb.prompt_length
    running = keep.long().cumsum(-1) - 1
    seqs = _real_tokens(mb)
    index = torch.zeros(b, S, dtype=torch.long, device=keep.device)
    rows_index: list[torch.Tensor] = []
    ids, pos, seq, segments = [], [], [], []
    n = 0
    for r, tokens in enumerate(seqs):
        best, shared = None, 0
        for q in range(r):
            if min(len(tokens), len(seqs[q])) > shared:
                k = common_prefix(tokens, seqs[q])
                if k > shared:
                    best, shared = q, k
        context = rows_index[best][:shared] if best is not None else torch.zeros(0, dtype=torch.long,
                                                                                  device=keep.device)
        own = len(tokens) - shared
        if own:
            segments.append(TreeSegment(n, n + own, context))
            ids.append(tokens[shared:])
            pos.append(running[r][keep[r]][shared:])
            seq.append(torch.full((own,), r, dtype=torch.long, device=keep.device))
        rows_index.append(torch.cat([context, n + torch.arange(own, device=keep.device)]))
        index[r][keep[r]] = rows_index[-1]
        n += own
    pad = -n % multiple
    if pad:
        segments.append(TreeSegment(n, n + pad, torch.zeros(0, dtype=torch.long, device=keep.device)))
        ids.append(torch.zeros(pad, dtype=torch.long, device=keep.device))
        pos.append(torch.arange(pad, device=keep.device))
        seq.append(torch.full((pad,), b, dtype=torch.long, device=keep.device))
    valid = keep[:, P:] & keep[:, P - 1:S - 1]
    rows, cols = valid.nonzero(as_tuple=True)
    T = n + pad
    cu = torch.tensor([0, T], dtype=torch.int32, device=keep.device)
    longest = max((len(s.context) + s.end - s.start for s in segments), default=0)
    cat = (lambda xs, dtype=torch.long: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype, device=keep.device))
    return PackedBatch(input_ids=cat(ids).to(mb.input_ids.dtype)[None], position_ids=cat(pos)[None],
                       seq_ids=cat(seq), cu_seqlens=cu, max_seqlen=longest, src=index[rows, P - 1 + cols], rows=rows,
                       cols=cols, targets=mb.input_ids[rows, P + cols], shape=(b, S - P), tree=tuple(segments))


def tree_tokens(mb: RolloutBatch) -> tuple[int, int]:
    """(tokens `pack_tree` lays out, tokens `pack` would) for these rows, without packing them: the distinct
    prefixes of the rows' real tokens, counted over the rows in lexicographic order (each adds what it does not
    share with the row before it), so a whole batch costs b log b comparisons, not b²."""
    ordered = sorted(_real_tokens(mb), key=lambda t: t.tolist())
    total = sum(len(s) for s in ordered)
    return total - sum(common_prefix(a, b) for a, b in zip(ordered, ordered[1:])), total


def block_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked out (megatron's convention): causal within each sequence, nothing
    across sequences."""
    T = seq_ids.numel()
    causal = torch.ones(T, T, dtype=torch.bool, device=seq_ids.device).tril()
    allowed = causal & (seq_ids[:, None] == seq_ids[None, :])
    return ~allowed[None, None]


def token_budget_slices(lengths: list[int], max_tokens: int,
                        seqs: list[torch.Tensor] | None = None) -> list[slice]:
    """Consecutive rows per micro-batch, as many as fit in `max_tokens` real tokens (at least one row each). With
    `seqs` (the rows' real tokens: a `pack_tree` layout) a row costs only the tokens it does not share with a
    row already in the micro-batch; a prefix tree that does not fit is split there (`tree_metrics` counts it)."""
    slices, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise VerlConfigError(f"a sequence of {n} tokens (prompt + response) exceeds the micro-batch token budget "
                                  f"max_tokens_per_micro_batch={max_tokens}; raise it to at least "
                                  f"data.max_prompt_length + rollout.max_new_tokens, or set it to 0 (count-based)")
        cost = n if seqs is None else n - max((common_prefix(seqs[i], seqs[q]) for q in range(start, i)), default=0)
        if used + cost > max_tokens:
            slices.append(slice(start, i))
            start, used, cost = i, 0, n
        used += cost
    if start < len(lengths):
        slices.append(slice(start, len(lengths)))
    return slices


def tree_metrics(batch: RolloutBatch, slices: list[slice]) -> dict[str, int]:
    """What `pack_tree` over these micro-batches computes: tokens laid out (`tree_tokens`), tokens plain packing
    would lay out (`plain_tokens`), boundaries between micro-batches that cut a group of rows with the same prompt
    (`splits`: its prompt is computed once per side), and the tokens computed again at the cuts (`split_tokens`:
    against one tree over the whole batch)."""
    per = [tree_tokens(batch.select(sl))[0] for sl in slices]
    whole, plain = tree_tokens(batch)
    keep = batch.attention_mask.bool()
    P = batch.prompt_length

    def prompt(r: int) -> torch.Tensor:
        return batch.input_ids[r, :P][keep[r, :P]]
    splits = sum(1 for a in slices[1:] if torch.equal(prompt(a.start), prompt(a.start - 1)))
    return {"tree_tokens": sum(per), "plain_tokens": plain, "splits": splits, "split_tokens": sum(per) - whole}


class TreeCounts:
    """`tree_metrics` summed over an engine's passes until a worker takes them as metrics."""

    def __init__(self):
        self.sums: dict[str, int] = {}

    def add(self, batch: RolloutBatch, slices: list[slice]) -> None:
        for k, v in tree_metrics(batch, slices).items():
            self.sums[k] = self.sums.get(k, 0) + v

    def take(self, role: str) -> dict[str, float]:
        """{role}/tree_token_ratio (tokens plain packing lays out per token the trees do: 1 = nothing shared),
        {role}/tree_splits and {role}/tree_split_tokens since the last call; {} without tree passes."""
        sums, self.sums = self.sums, {}
        if not sums.get("tree_tokens"):
            return {}
        return {f"{role}/tree_token_ratio": sums["plain_tokens"] / sums["tree_tokens"],
                f"{role}/tree_splits": float(sums["splits"]), f"{role}/tree_split_tokens": float(sums["split_tokens"])}


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
                       group: dist.ProcessGroup | None = None, tree: TreeCounts | None = None) -> list[slice]:
    """Row ranges of the micro-batches: `micro_batch_size` rows each, or (max_tokens > 0) filled by real tokens
    up to `max_tokens`, with the same number of micro-batches on every rank of `group` (collective then). `tree`:
    the micro-batches are `pack_tree` layouts, whose tokens the budget counts; what they compute is added to it."""
    if max_tokens <= 0:
        slices = micro_slices(len(batch), micro_batch_size)
    else:
        slices = token_budget_slices(batch.attention_mask.sum(-1).tolist(), max_tokens,
                                     None if tree is None else _real_tokens(batch))
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            from verl.distributed.placement import comm_device
            count = torch.tensor([len(slices)], dtype=torch.long, device=comm_device())
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
            slices = _split_to(slices, int(count))
    if tree is not None:
        tree.add(batch, slices)
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
    inside the block: `VARLEN` attention from the row's `cu_seqlens` (or `pack_tree`'s segments) where
    `check_varlen_attention` chooses it, else the position ids alone (flash-attention, or transformers' block
    mask), or a tree's dense mask."""
    impl = check_varlen_attention(module)
    trunk = getattr(module, "trunk", module)
    if packed.tree is not None:
        window = next((m.sliding_window for m in trunk.modules() if getattr(m, "sliding_window", None)), None)
        if window is not None:
            raise VerlConfigError(f"share_prompt_prefix (actor or critic): {type(trunk).__name__} has "
                                  f"sliding-window attention (sliding_window={window}), which a prefix tree's "
                                  f"attention does not apply; set share_prompt_prefix=false in that role's section")
        if impl.startswith("flash"):
            raise VerlConfigError(f"share_prompt_prefix (actor or critic): attn_implementation={impl!r} runs "
                                  f"causal sequences only, not a prefix tree; load the model with "
                                  f"attn_implementation='sdpa', or set share_prompt_prefix=false in that role's "
                                  f"section")
        if impl != VARLEN:
            yield {"attention_mask": packed.attention}
            return
        with varlen_attention(trunk):
            yield {"attention_mask": None, "verl_tree": packed.tree}
        return
    if impl != VARLEN:
        yield {"attention_mask": None}
        return
    # host-side boundaries: the attention slices the row by them in every layer without a device sync
    cu = packed.cu_seqlens.cpu()
    with varlen_attention(trunk):
        yield {"attention_mask": None, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": packed.max_seqlen,
               "max_length_k": packed.max_seqlen}
