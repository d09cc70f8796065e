"""Parameter metadata of the 3D-HybridEngine: what each Megatron parameter is in Hugging Face terms, and how
the training and the generation layouts cut it.

Everything here is metadata (names, shapes, ranges): no tensor is touched, so the planner built on it runs
on one process. A weight is cut along one dimension (`dim`); a rank's piece of a weight is described as an
ordered list of `Segment`s, each a range of rows of one Hugging Face tensor along that dimension. That one
description covers every Megatron layout:

- `qkv`: megatron-core's fused QKV is, per query group, [q heads of the group, k head, v head]; the groups
  are split across TP ranks, so TP rank r holds groups [r·G/TP, (r+1)·G/TP) → 3 segments per group.
- `gate_up`: megatron-core's fused SwiGLU fc1 holds [gate_shard_r; up_shard_r] on TP rank r → 2 segments.
- `vocab`: the vocabulary is padded (make_vocab_size_divisible_by × TP); padding rows have no HF name.
  Generation shards split the padded vocabulary too and leave out its padding rows.
- `column` / `row`: a plain split of dim 0 / dim 1; `replicated`: every TP rank holds the whole tensor.

Generation side (TP_g shards, no pipeline): the `hf` format gives each generation rank the HF-named tensors
narrowed to its TP_g shard (the full tensors when TP_g = 1); the `vllm` format fuses q/k/v into
`qkv_proj` and gate/up into `gate_up_proj` per shard, as vLLM's tensor-parallel layers hold them. When TP_g
exceeds the number of KV heads, each KV head is replicated on TP_g / KV ranks (vLLM's convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from verl.errors import VerlConfigError

__all__ = ["Segment", "ParamSpec", "Target", "LAYOUTS", "FORMATS", "training_segments", "generation_targets",
           "llama_param_specs"]

LAYOUTS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")
FORMATS = ("hf", "vllm")


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [start, start + length) along the cut dimension of HF tensor `hf_name` (None: padding rows)."""

    hf_name: str | None
    start: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One Megatron parameter of the training model, described by metadata alone."""

    name: str
    """Megatron name with the GLOBAL layer index (e.g. "decoder.layers.3.self_attention.linear_qkv.weight")."""
    hf_names: tuple[str, ...]
    """The Hugging Face tensors it holds, in fused order (q, k, v / gate, up / a single name)."""
    hf_shapes: tuple[tuple[int, ...], ...]
    """Full shape of each HF tensor, aligned with `hf_names`."""
    layout: Literal["replicated", "column", "row", "vocab", "qkv", "gate_up"]
    """How Megatron stores and TP-splits it (see the module docstring)."""
    dim: int = 0
    """The dimension the TP split (and every segment) runs along: 0 for column/qkv/gate_up/vocab, 1 for row."""
    layer: int | None = None
    """Global transformer layer index; None for embeddings, final norm and output layer."""
    stage: int = 0
    """Pipeline stage that owns it."""
    dtype: torch.dtype = torch.float32
    """Element type on the training ranks (decides bucket bytes)."""
    num_heads: int = 0
    """qkv only: number of query heads."""
    num_kv_heads: int = 0
    """qkv only: number of KV heads (Megatron's query groups)."""
    head_dim: int = 0
    """qkv only: size of one head along `dim`."""
    padded_rows: int = 0
    """vocab only: Megatron's padded vocabulary size (>= the HF vocabulary)."""
    global_segments: tuple[Segment, ...] = ()
    """When given (verl.models' ShardSpec), the whole Megatron tensor along `dim` as segments; TP rank r
    holds its r-th contiguous chunk. This also covers megatron-core's split of QKV groups when TP exceeds
    the KV heads. Empty: the segments are derived from `layout`."""

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def rest(self, hf_index: int = 0) -> tuple[int, ...]:
        """Shape of the HF tensor with the cut dimension set to 1 (the per-row shape)."""
        s = list(self.hf_shapes[hf_index])
        s[self.dim] = 1
        return tuple(s)

    def row_numel(self) -> int:
        return math.prod(self.rest())


@dataclass(frozen=True, slots=True)
class Target:
    """One tensor that one generation rank hands to its engine: rows of HF tensors concatenated along `dim`."""

    name: str
    shape: tuple[int, ...]
    dim: int
    segments: tuple[Segment, ...] = field(default=())


def _even(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if total % parts:
        raise VerlConfigError(f"{what}: {total} does not divide into {parts} tensor-parallel shards; choose a TP size "
                              f"that divides {total}")
    n = total // parts
    return index * n, n


def _check_qkv(spec: ParamSpec, tp: int) -> None:
    if spec.num_heads % spec.num_kv_heads:
        raise VerlConfigError(f"{spec.name}: num_heads={spec.num_heads} is not a multiple of "
                              f"num_kv_heads={spec.num_kv_heads}")
    if spec.num_kv_heads % tp:
        raise VerlConfigError(f"{spec.name}: Megatron splits the {spec.num_kv_heads} query groups across TP={tp} "
                              f"ranks, which needs TP to divide the number of KV heads; choose TP in "
                              f"{[d for d in range(1, spec.num_kv_heads + 1) if spec.num_kv_heads % d == 0]}")


def _chunk(segments: tuple[Segment, ...], tp: int, tp_rank: int, what: str) -> list[Segment]:
    total = sum(s.length for s in segments)
    lo, n = _even(total, tp, tp_rank, what)
    out, pos = [], 0
    for seg in segments:
        a, b = max(lo, pos), min(lo + n, pos + seg.length)
        if a < b:
            out.append(Segment(seg.hf_name, seg.start + (a - pos), b - a))
        pos += seg.length
    return out


def training_segments(spec: ParamSpec, tp: int, tp_rank: int) -> list[Segment]:
    """The rows of HF tensors held (in order, along spec.dim) by Megatron TP rank `tp_rank` of `tp`."""
    if spec.global_segments:
        return list(spec.global_segments) if spec.layout == "replicated" else \
            _chunk(spec.global_segments, tp, tp_rank, spec.name)
    if spec.layout == "replicated":
        return [Segment(spec.hf_names[0], 0, spec.hf_shapes[0][spec.dim])]
    if spec.layout in ("column", "row"):
        start, n = _even(spec.hf_shapes[0][spec.dim], tp, tp_rank, spec.name)
        return [Segment(spec.hf_names[0], start, n)]
    if spec.layout == "vocab":
        vocab = spec.hf_shapes[0][0]
        start, n = _even(spec.padded_rows, tp, tp_rank, spec.name + " (padded vocabulary)")
        real = max(0, min(start + n, vocab) - start)
        segs = [Segment(spec.hf_names[0], start, real)] if real else []
        return segs + ([Segment(None, start + real, n - real)] if n - real else [])
    if spec.layout == "gate_up":
        start, n = _even(spec.hf_shapes[0][0], tp, tp_rank, spec.name)
        return [Segment(spec.hf_names[0], start, n), Segment(spec.hf_names[1], start, n)]
    if spec.layout == "qkv":
        _check_qkv(spec, tp)
        q, k, v = spec.hf_names
        per_group = spec.num_heads // spec.num_kv_heads
        groups = spec.num_kv_heads // tp
        segs = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            segs += [Segment(q, g * per_group * spec.head_dim, per_group * spec.head_dim),
                     Segment(k, g * spec.head_dim, spec.head_dim), Segment(v, g * spec.head_dim, spec.head_dim)]
        return segs
    raise VerlConfigError(f"{spec.name}: unknown layout {spec.layout!r}; expected one of {LAYOUTS}")


def _kv_heads_of(spec: ParamSpec, tp_g: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) that generation TP rank `rank` holds; replicated when TP_g > KV heads."""
    kv = spec.num_kv_heads
    if tp_g <= kv:
        return _even(kv, tp_g, rank, spec.name + " (KV heads)")
    if tp_g % kv:
        raise VerlConfigError(f"{spec.name}: generation TP={tp_g} exceeds the {kv} KV heads but is not a multiple of "
                              f"it, so KV heads cannot be replicated evenly; choose TP_g dividing or a multiple "
                              f"of {kv}")
    return rank * kv // tp_g, 1


def _shape_with(spec: ParamSpec, hf_index: int, rows: int) -> tuple[int, ...]:
    s = list(spec.hf_shapes[hf_index])
    s[spec.dim] = rows
    return tuple(s)


def generation_targets(spec: ParamSpec, tp_g: int, rank: int, fmt: str = "hf") -> list[Target]:
    """The tensors generation TP rank `rank` of `tp_g` receives for `spec`, in the engine format `fmt`."""
    if fmt not in FORMATS:
        raise VerlConfigError(f"unknown generation weight format {fmt!r}; choose one of {FORMATS}")
    if spec.layout == "qkv":
        if spec.num_heads % tp_g:
            raise VerlConfigError(f"{spec.name}: {spec.num_heads} query heads do not split over generation TP={tp_g}")
        hq = spec.num_heads // tp_g
        k0, nk = _kv_heads_of(spec, tp_g, rank)
        hd = spec.head_dim
        segs = [Segment(spec.hf_names[0], rank * hq * hd, hq * hd), Segment(spec.hf_names[1], k0 * hd, nk * hd),
                Segment(spec.hf_names[2], k0 * hd, nk * hd)]
    elif spec.layout == "gate_up":
        start, n = _even(spec.hf_shapes[0][0], tp_g, rank, spec.name + " (generation)")
        segs = [Segment(spec.hf_names[0], start, n), Segment(spec.hf_names[1], start, n)]
    elif spec.layout == "replicated" or tp_g == 1:
        segs = [Segment(name, 0, shape[spec.dim]) for name, shape in zip(spec.hf_names, spec.hf_shapes)]
    elif spec.layout == "vocab":
        # Split the PADDED vocabulary as Megatron does (and vLLM's padded vocab-parallel layers do), so a
        # generation shard lines up with training shards; rows past the real vocabulary are not sent.
        vocab = spec.hf_shapes[0][0]
        per = -(-max(spec.padded_rows, vocab) // tp_g)
        start = min(rank * per, vocab)
        segs = [Segment(spec.hf_names[0], start, min(per, vocab - start))]
    else:  # column / row
        start, n = _even(spec.hf_shapes[0][spec.dim], tp_g, rank, spec.name + " (generation)")
        segs = [Segment(spec.hf_names[0], start, n)]
    segs = [s for s in segs if s.length > 0]
    if fmt == "vllm" and spec.layout in ("qkv", "gate_up"):
        fused = _vllm_fused_name(spec)
        return [Target(fused, _shape_with(spec, 0, sum(s.length for s in segs)), spec.dim, tuple(segs))]
    index = {n: i for i, n in enumerate(spec.hf_names)}
    return [Target(s.hf_name, _shape_with(spec, index[s.hf_name], s.length), spec.dim, (s,)) for s in segs]


def _vllm_fused_name(spec: ParamSpec) -> str:
    first = spec.hf_names[0]
    prefix, _, leaf = first.rpartition(".")          # leaf: "weight" / "bias"
    module = prefix.rpartition(".")[0]               # "...self_attn" / "...mlp"
    return f"{module}.{'qkv_proj' if spec.layout == 'qkv' else 'gate_up_proj'}.{leaf}"


def _pad_vocab(vocab: int, tp: int, multiple: int) -> int:
    step = multiple * tp
    return -(-vocab // step) * step


def llama_param_specs(config, *, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                      make_vocab_size_divisible_by: int = 128) -> list[ParamSpec]:
    """ParamSpecs of a Llama / Qwen2 / Mistral-family megatron-core GPTModel built from HF `config`.

    Names follow megatron-core's GPTModel with the Transformer-Engine layer spec (layer norms fused into
    linear_qkv / linear_fc1). Layers are split evenly over `pp` stages; embeddings live on stage 0, the final
    norm and output layer on the last stage (no output layer when the embeddings are tied).
    """
    L = config.num_hidden_layers
    if L % pp:
        raise VerlConfigError(f"{L} layers do not split evenly over PP={pp} stages; choose PP dividing {L}")
    H, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    hd = getattr(config, "head_dim", None) or H // nq
    qkv_bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
    padded = _pad_vocab(V, tp, make_vocab_size_divisible_by)
    last = pp - 1
    per_stage = L // pp
    common = dict(dtype=dtype)
    specs = [ParamSpec(name="embedding.word_embeddings.weight", hf_names=("model.embed_tokens.weight",),
                       hf_shapes=((V, H),), layout="vocab", padded_rows=padded, stage=0, **common)]
    for i in range(L):
        st = i // per_stage
        pre, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        lay = dict(layer=i, stage=st, **common)
        attn = dict(num_heads=nq, num_kv_heads=nkv, head_dim=hd)
        specs += [
            ParamSpec(name=pre + "self_attention.linear_qkv.layer_norm_weight",
                      hf_names=(hf + "input_layernorm.weight",),
                      hf_shapes=((H,),), layout="replicated", **lay),
            ParamSpec(name=pre + "self_attention.linear_qkv.weight",
                      hf_names=tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                      hf_shapes=((nq * hd, H), (nkv * hd, H), (nkv * hd, H)), layout="qkv", **attn, **lay),
        ]
        if qkv_bias:
            specs.append(ParamSpec(name=pre + "self_attention.linear_qkv.bias",
                                   hf_names=tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                                   hf_shapes=((nq * hd,), (nkv * hd,), (nkv * hd,)), layout="qkv", **attn, **lay))
        specs += [
            ParamSpec(name=pre + "self_attention.linear_proj.weight", hf_names=(hf + "self_attn.o_proj.weight",),
                      hf_shapes=((H, nq * hd),), layout="row", dim=1, **lay),
            ParamSpec(name=pre + "mlp.linear_fc1.layer_norm_weight", hf_names=(hf + "post_attention_layernorm.weight",),
                      hf_shapes=((H,),), layout="replicated", **lay),
            ParamSpec(name=pre + "mlp.linear_fc1.weight",
                      hf_names=(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                      hf_shapes=((F, H), (F, H)), layout="gate_up", **lay),
            ParamSpec(name=pre + "mlp.linear_fc2.weight", hf_names=(hf + "mlp.down_proj.weight",),
                      hf_shapes=((H, F),), layout="row", dim=1, **lay),
        ]
    specs.append(ParamSpec(name="decoder.final_layernorm.weight", hf_names=("model.norm.weight",), hf_shapes=((H,),),
                           layout="replicated", stage=last, **common))
    if not getattr(config, "tie_word_embeddings", False):
        specs.append(ParamSpec(name="output_layer.weight", hf_names=("lm_head.weight",), hf_shapes=((V, H),),
                               layout="vocab", padded_rows=padded, stage=last, **common))
    return specs
