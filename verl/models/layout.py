"""The one model of the Megatron ↔ Hugging Face weight layout (pure metadata: names, shapes, row ranges).

Two views of one model's weights, both derived from the parsed `ArchSpec`:

* the **HF tensors** (`TensorGroup`s, `hf_tensor_groups`): every tensor of the HF checkpoint with its shape,
  grouped as a generation engine may fuse them (q/k/v, gate/up) and tagged with how tensor parallelism cuts
  them. `hf_tensor_shapes` is the flat name → shape view (what export writes and load expects).
* the **training parameters** (`ShardSpec`s): each parameter's global tensor is the concatenation, along
  `dim`, of `segments` — row ranges of HF tensors, or zero padding — and rank k of `parts` along the
  training axis `axis` holds chunk k (rows [k·c, min((k+1)·c, total)) with c = ceil(total / parts): the
  even split megatron uses, and the dim-0 split of torch's FSDP2 whose last chunks may be short or empty);
  when `dim` is None every holder has the whole tensor.

`ModelLayout` bundles both for the 3D-HybridEngine; the megatron loader/exporter reads the `ShardSpec`s.

The two delicate megatron layouts, both megatron-core's own:

* fused QKV (`linear_qkv`): per query group g, ``[q heads of group g; k_g; v_g]`` (each head `head_dim`
  rows), groups in order. TP rank r holds rows ``[r*R/tp, (r+1)*R/tp)`` of that global matrix. When
  tp <= kv heads this is whole groups; when tp > kv heads megatron (0.16) cuts a group across ranks and
  all-gathers the projection output inside attention, so the same contiguous split stays correct.
* fused gate/up (`linear_fc1`): TP rank r holds ``[gate rows r; up rows r]`` (each ffn/tp rows), so the
  global matrix is ``[gate_0; up_0; gate_1; up_1; ...]`` — NOT ``[gate; up]``.

The vocabulary (embedding and untied output layer) is padded with zero rows up to a multiple of TP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from verl.errors import VerlConfigError
from verl.models.config import ArchSpec, ParallelLayout, arch_from_hf

KINDS = ("qkv-fused", "gate-up-fused", "column", "row", "vocab", "replicated", "value-head")
AXES = ("tp", "dp")
GROUP_KINDS = ("qkv", "gate_up", "row", "vocab", "replicated", "whole")


@dataclass(kw_only=True, slots=True, frozen=True)
class Segment:
    """`length` consecutive rows (along the cut dim) of one HF tensor, or zero padding."""

    hf_name: str | None
    """HF tensor name; None for zero padding (vocab padding rows)."""
    start: int
    """First index along the cut dim inside the HF tensor."""
    length: int
    """Number of indices."""


def _chunk(total: int, parts: int, k: int) -> tuple[int, int]:
    """(start, length) of chunk k of `parts`: ceil-sized chunks, the last ones short or empty (FSDP2's
    rule; equal to an even split whenever `parts` divides `total`, as megatron requires)."""
    c = -(-total // parts)
    start = min(k * c, total)
    return start, min(c, total - start)


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardSpec:
    """One training parameter and where its rows come from in Hugging Face terms (rank-independent)."""

    name: str
    """Canonical name: megatron's with the GLOBAL layer index (decoder.layers.5.mlp.linear_fc1.weight), or the
    HF name for a Hugging Face module."""
    local_name: str
    """The name in the holder's `module.named_parameters()` (megatron: layer index local to the stage)."""
    kind: str
    """One of KINDS (how megatron stores it; 'column' / 'replicated' for HF-module parameters)."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded tensor (megatron's vocab includes padding)."""
    dim: int | None
    """The dim the training layout cuts (0 column/vocab/fused/FSDP, 1 row); None when every holder has it all."""
    parts: int = 1
    """Number of chunks along `dim` (megatron: TP size; FSDP2: DP size)."""
    axis: str = "tp"
    """Which index of the training layout picks the chunk: 'tp' (megatron) or 'dp' (FSDP2)."""
    segments: tuple[Segment, ...]
    """The global tensor along `dim` (dim 0 when `dim` is None), in order."""
    layer: int | None = None
    """Global transformer layer index; None for embeddings, final norm and output layer."""
    stage: int = 0
    """Pipeline stage whose ranks hold it."""
    dtype: torch.dtype = torch.float32
    """Element type of the live parameter (decides bucket bytes)."""
    exported: bool = True
    """False for a copy that is not written on export (the tied output layer on the last pipeline stage)."""

    def __post_init__(self):
        if self.axis not in AXES:
            raise VerlConfigError(f"{self.name}: axis={self.axis!r}; choose one of {AXES}")
        total = sum(s.length for s in self.segments)
        if not self.global_shape or total != self.global_shape[self.cut_dim]:
            raise VerlConfigError(f"{self.name}: segments cover {total} rows but the tensor has shape "
                                  f"{self.global_shape} along dim {self.cut_dim}")

    @property
    def cut_dim(self) -> int:
        """The dim `segments` run along."""
        return 0 if self.dim is None else self.dim

    @property
    def hf_names(self) -> tuple[str, ...]:
        """HF tensors this parameter is built from (in layout order, padding excluded)."""
        return tuple(dict.fromkeys(s.hf_name for s in self.segments if s.hf_name is not None))

    def chunk(self, k: int) -> tuple[int, int]:
        """(start, length) along `cut_dim` of the global tensor that chunk k holds."""
        if self.dim is None:
            return 0, self.global_shape[0]
        return _chunk(self.global_shape[self.dim], self.parts, k)

    def local_shape(self, k: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.cut_dim] = self.chunk(k)[1]
        return tuple(shape)

    def local_segments(self, k: int) -> list[tuple[Segment, int]]:
        """The pieces of `segments` chunk k covers: (sub-segment, offset in the local tensor)."""
        lo, n = self.chunk(k)
        out, pos = [], 0
        for seg in self.segments:
            a, b = max(lo, pos), min(lo + n, pos + seg.length)
            if a < b:
                out.append((Segment(hf_name=seg.hf_name, start=seg.start + (a - pos), length=b - a), a - lo))
            pos += seg.length
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorGroup:
    """HF tensors a generation engine may fuse into one (q/k/v, gate/up), or one tensor on its own."""

    kind: str
    """One of GROUP_KINDS: how tensor parallelism cuts it — qkv (query heads; KV heads, replicated past their
    count), gate_up and vocab (rows; vocab as the engines pad it), row (columns), replicated (whole on every
    rank), whole (an architecture the layout model does not know: never cut, never fused)."""
    names: tuple[str, ...]
    """HF names, in fused order."""
    shapes: tuple[tuple[int, ...], ...]
    """Full shape of each tensor, aligned with `names`."""
    num_heads: int = 0
    """qkv: query heads."""
    num_kv_heads: int = 0
    """qkv: key/value heads."""
    head_dim: int = 0
    """qkv: rows per head."""

    def __post_init__(self):
        if self.kind not in GROUP_KINDS or len(self.names) != len(self.shapes):
            raise VerlConfigError(f"TensorGroup {self.names}: kind={self.kind!r} (one of {GROUP_KINDS}) with "
                                  f"{len(self.shapes)} shapes for {len(self.names)} names")

    @property
    def dim(self) -> int:
        """The dim generation tensor parallelism cuts."""
        return 1 if self.kind == "row" else 0


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelLayout:
    """One model's weights in both views: what the 3D-HybridEngine plans from."""

    architecture: str
    """HF model_type (or the module's class name), named in errors."""
    groups: tuple[TensorGroup, ...]
    """Every HF tensor the generation engine receives, grouped."""
    params: tuple[ShardSpec, ...]
    """Every training parameter (of every pipeline stage) that carries them."""
    unknown: str = ""
    """Why the layout model does not know this architecture ('' when it does): its tensors are then only
    handed over whole (HF names, generation TP 1)."""


def _seg(name: str | None, start: int, length: int) -> Segment:
    return Segment(hf_name=name, start=start, length=length)


# ------------------------------------------------------------------------------------------- HF tensors

def hf_tensor_groups(arch: ArchSpec, *, value_head: bool = False) -> tuple[TensorGroup, ...]:
    """Every tensor of the HF checkpoint, in model order (embeddings, layers, final norm, output)."""
    h, hd, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    vocab = dict(kind="vocab", shapes=((arch.vocab_size, h),))
    heads = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=hd)
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    groups = [TensorGroup(names=("model.embed_tokens.weight",), **vocab)]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        groups.append(TensorGroup(kind="replicated", names=(f"{p}.input_layernorm.weight",), shapes=((h,),)))
        groups.append(TensorGroup(kind="qkv", names=tuple(f"{p}.self_attn.{x}_proj.weight" for x in "qkv"),
                                  shapes=((q, h), (kv, h), (kv, h)), **heads))
        if arch.qkv_bias:
            groups.append(TensorGroup(kind="qkv", names=tuple(f"{p}.self_attn.{x}_proj.bias" for x in "qkv"),
                                      shapes=((q,), (kv,), (kv,)), **heads))
        groups += [
            TensorGroup(kind="row", names=(f"{p}.self_attn.o_proj.weight",), shapes=((h, q),)),
            TensorGroup(kind="replicated", names=(f"{p}.post_attention_layernorm.weight",), shapes=((h,),)),
            TensorGroup(kind="gate_up", names=(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"),
                        shapes=((f, h), (f, h))),
            TensorGroup(kind="row", names=(f"{p}.mlp.down_proj.weight",), shapes=((h, f),)),
        ]
    groups.append(TensorGroup(kind="replicated", names=("model.norm.weight",), shapes=((h,),)))
    if value_head:
        groups += [TensorGroup(kind="replicated", names=("score.weight",), shapes=((1, h),)),
                   TensorGroup(kind="replicated", names=("score.bias",), shapes=((1,),))]
    elif not arch.tie_word_embeddings:
        groups.append(TensorGroup(names=("lm_head.weight",), **vocab))
    return tuple(groups)


def hf_tensor_shapes(arch: ArchSpec, *, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape (what export writes, what load expects)."""
    return {n: s for g in hf_tensor_groups(arch, value_head=value_head) for n, s in zip(g.names, g.shapes)}


# ------------------------------------------------------------------------------------ megatron parameters

def _qkv_segments(arch: ArchSpec, hf_prefix: str, suffix: str) -> tuple[Segment, ...]:
    hd, qpg = arch.head_dim, arch.q_per_group
    segs = []
    for g in range(arch.num_kv_heads):
        segs += [_seg(f"{hf_prefix}.q_proj.{suffix}", g * qpg * hd, qpg * hd),
                 _seg(f"{hf_prefix}.k_proj.{suffix}", g * hd, hd),
                 _seg(f"{hf_prefix}.v_proj.{suffix}", g * hd, hd)]
    return tuple(segs)


def _gate_up_segments(arch: ArchSpec, hf_prefix: str, tp: int) -> tuple[Segment, ...]:
    n = arch.ffn_hidden_size // tp
    segs = []
    for r in range(tp):
        segs += [_seg(f"{hf_prefix}.gate_proj.weight", r * n, n), _seg(f"{hf_prefix}.up_proj.weight", r * n, n)]
    return tuple(segs)


def _vocab_segments(hf_name: str, arch: ArchSpec, layout: ParallelLayout) -> tuple[Segment, ...]:
    segs = [_seg(hf_name, 0, arch.vocab_size)]
    if layout.padded_vocab_size > arch.vocab_size:
        segs.append(_seg(None, 0, layout.padded_vocab_size - arch.vocab_size))
    return tuple(segs)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_table(arch: ArchSpec, tp: int, hp: str) -> dict[str, tuple]:
    """megatron layer parameter (local and TE spec names) → (kind, global shape, dim, segments)."""
    h = arch.hidden_size
    q_rows = arch.num_kv_heads * (arch.q_per_group + 2) * arch.head_dim
    attn = arch.num_heads * arch.head_dim
    ln1 = ("replicated", (h,), None, (_seg(f"{hp}.input_layernorm.weight", 0, h),))
    ln2 = ("replicated", (h,), None, (_seg(f"{hp}.post_attention_layernorm.weight", 0, h),))
    return {
        "input_layernorm.weight": ln1,
        "self_attention.linear_qkv.layer_norm_weight": ln1,
        "self_attention.linear_qkv.weight": ("qkv-fused", (q_rows, h), 0,
                                             _qkv_segments(arch, f"{hp}.self_attn", "weight")),
        "self_attention.linear_qkv.bias": ("qkv-fused", (q_rows,), 0, _qkv_segments(arch, f"{hp}.self_attn", "bias")),
        "self_attention.linear_proj.weight": ("row", (h, attn), 1, (_seg(f"{hp}.self_attn.o_proj.weight", 0, attn),)),
        "pre_mlp_layernorm.weight": ln2,
        "mlp.linear_fc1.layer_norm_weight": ln2,
        "mlp.linear_fc1.weight": ("gate-up-fused", (2 * arch.ffn_hidden_size, h), 0,
                                  _gate_up_segments(arch, f"{hp}.mlp", tp)),
        "mlp.linear_fc2.weight": ("row", (h, arch.ffn_hidden_size), 1,
                                  (_seg(f"{hp}.mlp.down_proj.weight", 0, arch.ffn_hidden_size),)),
    }


def _top_level(local_name: str, arch: ArchSpec, layout: ParallelLayout) -> tuple | None:
    """(kind, global shape, dim, segments, exported) of a non-layer megatron parameter, or None."""
    h, vp = arch.hidden_size, layout.padded_vocab_size
    if local_name == "embedding.word_embeddings.weight":
        return "vocab", (vp, h), 0, _vocab_segments("model.embed_tokens.weight", arch, layout), True
    if local_name == "output_layer.weight":
        tied = arch.tie_word_embeddings
        src = "model.embed_tokens.weight" if tied else "lm_head.weight"
        # A tied output layer only exists as a parameter on a last stage that is not also the first stage;
        # it is a copy of the embedding, kept in sync by megatron, so export skips it.
        return "vocab", (vp, h), 0, _vocab_segments(src, arch, layout), not tied
    if local_name == "decoder.final_layernorm.weight":
        return "replicated", (h,), None, (_seg("model.norm.weight", 0, h),), True
    if local_name in ("output_layer.value_head.weight", "output_layer.value_head.bias"):
        suffix = local_name.rsplit(".", 1)[1]
        return "value-head", (1, h) if suffix == "weight" else (1,), None, (_seg(f"score.{suffix}", 0, 1),), True
    return None


def shard_spec(local_name: str, *, arch: ArchSpec, layout: ParallelLayout, layer_offset: int, stage: int = 0,
               dtype: torch.dtype = torch.float32) -> ShardSpec:
    """The ShardSpec of one megatron parameter (local spec and TE spec names both understood)."""
    common = dict(local_name=local_name, parts=layout.tp_size, stage=stage, dtype=dtype)
    m = _LAYER_RE.match(local_name)
    if m:
        layer = int(m.group(1)) + layer_offset
        table = _layer_table(arch, layout.tp_size, f"model.layers.{layer}")
        if m.group(2) not in table:
            raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
        kind, shape, dim, segs = table[m.group(2)]
        return ShardSpec(name=f"decoder.layers.{layer}.{m.group(2)}", kind=kind, global_shape=shape, dim=dim,
                         segments=segs, layer=layer, **common)
    top = _top_level(local_name, arch, layout)
    if top is None:
        raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
    kind, shape, dim, segs, exported = top
    return ShardSpec(name=local_name, kind=kind, global_shape=shape, dim=dim, segments=segs, exported=exported,
                     **common)


_LAYER_PARAMS = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                 "mlp.linear_fc2.weight")


def megatron_shard_specs(arch: ArchSpec, layout: ParallelLayout, *, pp: int = 1, dtype: torch.dtype = torch.float32,
                         value_head: bool = False) -> list[ShardSpec]:
    """The exported parameters of every stage of the megatron GPTModel verl builds (megatron-core's local layer
    spec names, named_parameters order), without building it: metadata for planning on one process."""
    if arch.num_layers % pp:
        raise VerlConfigError(f"num_hidden_layers={arch.num_layers} is not divisible by pp={pp}; choose PP dividing it")
    per_stage, last = arch.num_layers // pp, pp - 1
    names = [(0, 0, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        stage = i // per_stage
        names += [(stage, stage * per_stage, f"decoder.layers.{i - stage * per_stage}.{rest}") for rest in _LAYER_PARAMS
                  if arch.qkv_bias or not rest.endswith("bias")]
    names.append((last, 0, "decoder.final_layernorm.weight"))
    if value_head:
        names += [(last, 0, "output_layer.value_head.weight"), (last, 0, "output_layer.value_head.bias")]
    elif not arch.tie_word_embeddings:
        names.append((last, 0, "output_layer.weight"))
    return [shard_spec(n, arch=arch, layout=layout, layer_offset=off, stage=st, dtype=dtype) for st, off, n in names]


def megatron_model_layout(arch: ArchSpec, layout: ParallelLayout, *, params: list[ShardSpec] | None = None,
                          pp: int = 1, dtype: torch.dtype = torch.float32, value_head: bool = False) -> ModelLayout:
    """The ModelLayout of a megatron GPT: `params` are a live model's ShardSpecs (every stage's); by default
    those `megatron_shard_specs` derives for `pp` stages of `dtype`."""
    if params is None:
        params = megatron_shard_specs(arch, layout, pp=pp, dtype=dtype, value_head=value_head)
    groups = hf_tensor_groups(arch, value_head=value_head)
    return ModelLayout(architecture=arch.model_type, groups=groups, params=tuple(p for p in params if p.exported))


# ------------------------------------------------------------------------------ Hugging Face modules

_HF_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _module_spec(name: str, t: torch.Tensor, shards: int) -> ShardSpec:
    shape = tuple(t.shape)
    if not shape:
        raise VerlConfigError(f"parameter {name!r} is a scalar; the hybrid engine moves tensors of rank >= 1")
    m = _HF_LAYER_RE.search(name)
    return ShardSpec(name=name, local_name=name, kind="replicated" if shards == 1 else "column", global_shape=shape,
                     dim=None if shards == 1 else 0, parts=shards, axis="dp", segments=(_seg(name, 0, shape[0]),),
                     layer=int(m.group(1)) if m else None, dtype=t.dtype)


def _known_groups(tensors: Mapping[str, torch.Tensor], hf_config) -> tuple[tuple[TensorGroup, ...] | None, str]:
    """The architecture's groups when the layout model knows it AND the module has exactly its tensors."""
    try:
        arch = arch_from_hf(hf_config)
    except VerlConfigError as e:
        return None, str(e)
    groups = hf_tensor_groups(arch)
    want = {n: s for g in groups for n, s in zip(g.names, g.shapes)}
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or sorted(n for n in want if want[n] != got[n])
        return None, f"its parameters differ from the {arch.model_type} layout (e.g. {diff[:3]})"
    return groups, ""


def hf_model_layout(tensors: Mapping[str, torch.Tensor], hf_config, *, shards: int = 1,
                    architecture: str | None = None) -> ModelLayout:
    """The ModelLayout of a Hugging Face module trained data-parallel.

    `tensors`: HF name → the parameter (only `.shape` and `.dtype` are read; the global shape for FSDP2).
    shards == 1: every rank holds every tensor whole (plain torch DDP / single process); shards > 1: FSDP2,
    each tensor cut along dim 0 into `shards` chunks, DP rank k holding chunk k. An architecture the layout
    model does not know gets a layout of whole, unfusable tensors. `architecture` names the model in errors
    (default: the config's model_type).
    """
    params = tuple(_module_spec(n, t, shards) for n, t in tensors.items())
    architecture = architecture or getattr(hf_config, "model_type", None) or type(hf_config).__name__
    groups, unknown = _known_groups(tensors, hf_config)
    if groups is None:
        groups = tuple(TensorGroup(kind="whole", names=(n,), shapes=(tuple(t.shape),)) for n, t in tensors.items())
    return ModelLayout(architecture=architecture, groups=groups, params=params, unknown=unknown)
