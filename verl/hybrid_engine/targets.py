"""Generation formats: the tensors a generation rank hands to its engine, defined from the architecture's
HF tensors (`verl.models.layout.TensorGroup`), never from how training happens to store them.

A `Target` is a list of HF-tensor row ranges concatenated along `dim`. Generation layout: TP_g shards, no
pipeline.

- `hf`: each HF tensor narrowed to the rank's TP_g shard (the whole tensor when TP_g = 1): query heads,
  gate/up rows and the padded vocabulary split by rows, o_proj/down_proj by columns, norms whole.
- `vllm`: as vLLM's tensor-parallel layers hold them: q/k/v fused into `qkv_proj` and gate/up into
  `gate_up_proj` per TP_g shard ([q_r; k_r; v_r], [gate_r; up_r]), everything else as in `hf`.

When TP_g exceeds the KV heads each KV head is replicated on TP_g / KV ranks (vLLM's convention). The
vocabulary is split as the engines' vocab-parallel layers split it (padded to a multiple of 64, equal ranges
per rank), and padding rows are never sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.errors import VerlConfigError
from verl.models.layout import Segment, TensorGroup

__all__ = ["FORMATS", "Target", "generation_targets"]

FORMATS = ("hf", "vllm")


@dataclass(frozen=True, slots=True)
class Target:
    """One tensor that one generation rank hands to its engine: rows of HF tensors concatenated along `dim`."""

    name: str
    shape: tuple[int, ...]
    dim: int
    segments: tuple[Segment, ...]


def _even(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if total % parts:
        raise VerlConfigError(f"{what}: {total} does not divide into {parts} tensor-parallel shards; choose a "
                              f"generation TP that divides {total}")
    n = total // parts
    return index * n, n


def _kv_heads_of(group: TensorGroup, tp_g: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) that generation TP rank `rank` holds; replicated when TP_g > KV heads."""
    kv, what = group.num_kv_heads, group.names[1]
    if tp_g <= kv:
        return _even(kv, tp_g, rank, what + " (KV heads)")
    if tp_g % kv:
        raise VerlConfigError(f"{what}: generation TP={tp_g} exceeds the {kv} KV heads but is not a multiple of "
                              f"it, so KV heads cannot be replicated evenly; choose TP_g dividing or a multiple "
                              f"of {kv}")
    return rank * kv // tp_g, 1


def _segments(group: TensorGroup, tp_g: int, rank: int) -> list[Segment]:
    names, kind = group.names, group.kind
    if kind == "qkv":
        if group.num_heads % tp_g:
            raise VerlConfigError(f"{names[0]}: {group.num_heads} query heads do not split over generation "
                                  f"TP={tp_g}; choose a generation TP dividing {group.num_heads}")
        hq, hd = group.num_heads // tp_g, group.head_dim
        k0, nk = _kv_heads_of(group, tp_g, rank)
        return [Segment(hf_name=names[0], start=rank * hq * hd, length=hq * hd),
                Segment(hf_name=names[1], start=k0 * hd, length=nk * hd),
                Segment(hf_name=names[2], start=k0 * hd, length=nk * hd)]
    if kind == "gate_up":
        start, n = _even(group.shapes[0][0], tp_g, rank, names[0] + " (generation)")
        return [Segment(hf_name=name, start=start, length=n) for name in names]
    if kind == "whole" and tp_g > 1:
        raise VerlConfigError(f"{names[0]}: the layout model does not know how tensor parallelism cuts it; use "
                              f"generation_tp=1")
    if kind in ("replicated", "whole") or tp_g == 1:
        return [Segment(hf_name=n, start=0, length=s[group.dim]) for n, s in zip(names, group.shapes)]
    if kind == "vocab":
        # Split the vocabulary as the engines' vocab-parallel layers hold it (vLLM and SGLang pad it to a
        # multiple of ENGINE_VOCAB_PADDING, then give each TP rank an equal range); padding rows are not sent.
        vocab = group.shapes[0][0]
        padded = -(-vocab // ENGINE_VOCAB_PADDING) * ENGINE_VOCAB_PADDING
        if padded % tp_g:
            raise VerlConfigError(f"{names[0]}: the engines' padded vocabulary of {padded} rows does not split over "
                                  f"generation TP={tp_g}; choose a generation TP dividing {padded}")
        per = padded // tp_g
        start = min(rank * per, vocab)
        return [Segment(hf_name=names[0], start=start, length=min(per, vocab - start))]
    start, n = _even(group.shapes[0][1], tp_g, rank, names[0] + " (generation)")  # row: columns
    return [Segment(hf_name=names[0], start=start, length=n)]


ENGINE_VOCAB_PADDING = 64
"""vLLM's (and SGLang's) DEFAULT_VOCAB_PADDING_SIZE: the multiple their vocab-parallel layers pad to."""


def _shape_with(group: TensorGroup, index: int, rows: int) -> tuple[int, ...]:
    s = list(group.shapes[index])
    s[group.dim] = rows
    return tuple(s)


def _vllm_fused_name(group: TensorGroup) -> str:
    prefix, _, leaf = group.names[0].rpartition(".")      # leaf: "weight" / "bias"
    module = prefix.rpartition(".")[0]                     # "...self_attn" / "...mlp"
    return f"{module}.{'qkv_proj' if group.kind == 'qkv' else 'gate_up_proj'}.{leaf}"


def generation_targets(group: TensorGroup, tp_g: int, rank: int, fmt: str = "hf") -> list[Target]:
    """The tensors generation TP rank `rank` of `tp_g` receives for `group`, in the engine format `fmt`."""
    if fmt not in FORMATS:
        raise VerlConfigError(f"unknown generation weight format {fmt!r}; choose one of {FORMATS}")
    if fmt == "vllm" and group.expert is not None:
        raise VerlConfigError(f"{group.names[0]}: vLLM's fused-MoE layers hold each rank's experts as one "
                              f"[experts, rows, hidden] tensor (w13 / w2), a layout the hybrid engine does not "
                              f"produce; "
                              f"generate mixture-of-experts models at rollout.tp=1 (the 'hf' format, which vLLM's own "
                              f"loader fuses)")
    segs = [s for s in _segments(group, tp_g, rank) if s.length > 0]
    if fmt == "vllm" and group.kind in ("qkv", "gate_up"):
        return [Target(_vllm_fused_name(group), _shape_with(group, 0, sum(s.length for s in segs)), group.dim,
                       tuple(segs))]
    index = {n: i for i, n in enumerate(group.names)}
    return [Target(s.hf_name, _shape_with(group, index[s.hf_name], s.length), group.dim, (s,)) for s in segs]
